"""FP8 KV pages against a float cache on tiny random families (dense, sliding window, Gemma 4's shared KV and
head sizes, gpt-oss's sinks, DeepSeek-V3's latent pages), in bfloat16 and float32 compute: per-token
log-probabilities of a fixed continuation (prefilled in chunks) and of greedy decoded tokens stay within a measured
bound, a prefix-cache hit on FP8 pages decodes exactly what computing them decoded, and preemption recomputes the
same answers."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.sample.params import SamplingParams
from tests.engine.conftest import TOKENIZER_FILES
from tests.engine.model.family_parity import check_preemption, tiny_engine
from tests.engine.model.gpt_oss_checkpoints import build_gpt_oss
from tests.engine.model.mla_checkpoints import build_mla_checkpoint
from tests.engine.model.test_gemma4_parity import save_tiny_gemma4

# |logprob(fp8 pages) - logprob(float pages)| of one token, the largest and the mean over a run below: the 20
# teacher-forced tokens and the 16 decoded ones. Measured, bfloat16 / float32 compute, teacher-forced then
# decoded, largest (mean): llama 0.56 (0.19), 0.60 (0.13) / 0.62 (0.21), 0.21 (0.07); window 0.68 (0.23), 0.49
# (0.14) / 0.72 (0.29), 0.45 (0.10); gemma4 0.76 (0.19), 0.30 (0.13) / 0.55 (0.19), 0.39 (0.12); gpt-oss 0.23
# (0.09), 0.15 (0.06) / 0.24 (0.10), 0.14 (0.06); deepseek_v3 (MLA latent pages) 0.47 (0.08), 0.57 (0.08) / 0.80
# (0.10), 0.16 (0.03). The bounds are 1.5x the largest of each. e4m3 keeps 3 mantissa
# bits: each K and V element moves by up to 1/16 of itself (2.6% in L2 over a layer's K or V, measured on
# SmolLM2-135M, with scale 1.0 or amax / 448 alike), and these random models' large weights make scores large
# and logits peaked, which turns that into tenths of a nat on their least certain tokens.
FP8_LOGPROB_MAX = 1.2
FP8_LOGPROB_MEAN = 0.45
FAMILIES = ["llama", "window", "gemma4", "gpt_oss", "deepseek_v3"]
VOCAB = 128  # below every family's vocabulary (Gemma 4's and gpt-oss's tiny ones hold 128 ids)


@pytest.fixture(scope="module")
def family_path(request, tmp_path_factory, baked_model_path):
    """Each family's tiny checkpoint with SmolLM2's tokenizer beside it (ids below 128 only)."""
    paths = {}

    def get(name: str):
        if name == "llama":
            return request.getfixturevalue("tiny_model_path")
        if name == "window":
            return request.getfixturevalue("tiny_window_model_path")
        if name not in paths:
            path = tmp_path_factory.mktemp(name)
            if name == "gemma4":
                save_tiny_gemma4(path)
            elif name == "deepseek_v3":  # multi-head latent attention: FP8 latent pages
                build_mla_checkpoint(name, path)
            else:
                build_gpt_oss(path, "float")
            for f in TOKENIZER_FILES:
                if (baked_model_path / f).exists() and f != "generation_config.json":
                    shutil.copy(baked_model_path / f, path / f)
            paths[name] = path
        return paths[name]

    return get


def finish(engine, request_id: str, ids: list[int], params: SamplingParams):
    """Steps one request to its end; returns (prompt logprobs, generated tokens, their logprobs, cached tokens)."""
    engine.add_request(request_id, ids, params)
    prompt, tokens, logprobs, cached = None, [], [], 0
    while engine.has_unfinished():
        for out in engine.step():
            prompt = prompt or out.prompt_logprobs
            cached = max(cached, out.num_cached_tokens)
            tokens += out.outputs[0].token_ids
            logprobs += [p.chosen.logprob for p in out.outputs[0].logprobs or []]
    assert not engine.pop_failures()
    return prompt, tokens, logprobs, cached


def forced(engine, request_id: str, ids: list[int], start: int) -> tuple[list[float], int]:
    """The logprob of each of ids[start:] given what precedes it, and how many prompt tokens were cached."""
    prompt, _, _, cached = finish(engine, request_id, ids, SamplingParams(max_tokens=1, prompt_logprobs=0))
    return [p.chosen.logprob for p in prompt[start:]], cached


def within_bound(a: list[float], b: list[float]) -> bool:
    assert len(a) == len(b) > 0
    diffs = [abs(x - y) for x, y in zip(a, b, strict=True)]
    return max(diffs) < FP8_LOGPROB_MAX and sum(diffs) / len(diffs) < FP8_LOGPROB_MEAN


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_pages_keep_logprobs_within_the_bound(family, dtype, family_path):
    path = family_path(family)
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, VOCAB, (30,), generator=gen).tolist()  # past every window (8)
    continuation = torch.randint(3, VOCAB, (20,), generator=gen).tolist()
    # 16-token steps: the 50 tokens prefill in four chunks, each attending over the FP8 pages of the last.
    engines = {kv: tiny_engine(path, dtype=dtype, kv_cache_dtype=kv, num_kv_pages=96) for kv in ("auto", "fp8")}
    teacher = {kv: forced(e, "t", prompt + continuation, len(prompt)) for kv, e in engines.items()}
    assert within_bound(teacher["fp8"][0], teacher["auto"][0])

    # Decode: the FP8 engine's greedy tokens and their logprobs against the float cache's for the same tokens.
    _, tokens, decoded, _ = finish(
        engines["fp8"], "g", prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    )
    assert len(tokens) == 16
    assert within_bound(decoded, forced(engines["auto"], "g", prompt + tokens, len(prompt))[0])

    # A prefix-cache hit reads the FP8 pages "g" wrote, and decodes what computing them again decoded.
    _, hit_tokens, hit, cached = finish(
        engines["fp8"], "h", prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    )
    assert cached >= len(prompt) - len(prompt) % 4
    assert hit_tokens == tokens and hit == decoded


@pytest.mark.parametrize("family", ["gemma4", "gpt_oss", "deepseek_v3"])
def test_preemption_on_fp8_pages_recomputes_the_same_tokens(family, family_path):
    check_preemption(family_path(family), kv_cache_dtype="fp8")
