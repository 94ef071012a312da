"""KV_CACHE_DTYPE=fp8 in the engine: the pool holds twice bf16's pages for the same bytes, the logits stay within
the stated drift of bf16 pages, and prefix caching, forks, preemption and window groups run on FP8 pages exactly
as on float ones (every run compared with the same requests alone, on FP8 pages too)."""

from __future__ import annotations

import pytest
import torch

from engine.attention.kv_quant import FP8
from engine.attention.torch_ref import TorchRefBackend
from engine.model.loader import load_model
from engine.sample.params import SamplingParams
from tests.engine.core.engine_run import greedy, make_engine, random_prompts, run

# Relative L2 distance of a tiny random model's logits, FP8 pages against bf16 pages, both under a bf16 model:
# measured 0.075 (Llama and Qwen3 of tests/engine/conftest.py TINY); e4m3 keeps 3 mantissa bits to bf16's 7.
TINY_LOGIT_DRIFT = 0.10


@pytest.fixture(scope="module")
def fp8_alone(tiny_model_path):
    return make_engine(tiny_model_path, page_size=4, enable_prefix_caching=False, kv_cache_dtype="fp8")


def alone(engine, prompt: list[int], params: SamplingParams) -> list[int]:
    return run(engine, {"x": (prompt, params)})["x"].choices[0].token_ids


def test_fp8_pages_double_the_pool_of_bf16_for_the_same_bytes(tiny_model_path):
    budget = 3 << 20
    bf16 = make_engine(tiny_model_path, dtype="bfloat16", num_kv_pages=None, kv_cache_bytes=budget)
    fp8 = make_engine(
        tiny_model_path, dtype="bfloat16", num_kv_pages=None, kv_cache_bytes=budget, kv_cache_dtype="fp8_e4m3"
    )
    assert fp8.allocator.num_pages == 2 * bf16.allocator.num_pages
    assert fp8.pool.data.dtype == FP8 and bf16.pool.data.dtype == torch.bfloat16
    assert fp8.describe()["kv_dtype"] == "float8_e4m3fn" and bf16.describe()["kv_dtype"] == "bfloat16"
    assert fp8.describe()["kv_bytes"] == bf16.describe()["kv_bytes"]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_tiny_model_logits_stay_within_the_stated_drift_of_bf16_pages(kind, tmp_path, tiny_checkpoint, paged_harness):
    tiny_checkpoint(kind, tmp_path)
    model, spec = load_model(str(tmp_path), torch.bfloat16, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    batch = [(r, torch.randint(0, 128, (n,), generator=gen).tolist()) for r, n in (("a", 9), ("b", 1), ("c", 40))]
    logits = []
    for kv_dtype in (torch.bfloat16, FP8):
        harness = paged_harness(
            num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, dtype=kv_dtype
        )
        input_ids, positions, meta = harness.step(batch)
        backend = TorchRefBackend("cpu")
        backend.plan(meta)
        with torch.inference_mode():
            logits.append(model.compute_logits(model(input_ids, positions, meta, harness.kv_caches, backend)))
    bf16, fp8 = logits
    drift = float((fp8 - bf16).norm() / bf16.norm())
    assert 0.0 < drift < TINY_LOGIT_DRIFT


def test_a_batch_on_fp8_pages_equals_each_request_alone(fp8_alone, tiny_model_path):
    prompts = random_prompts(10, 1, 50, seed=2)
    params = [greedy(3 + i % 8, ignore_eos=True) for i in range(10)]
    expected = [alone(fp8_alone, p, sp) for p, sp in zip(prompts, params, strict=True)]
    engine = make_engine(tiny_model_path, page_size=4, kv_cache_dtype="fp8")
    got = run(
        engine,
        {str(i): (p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))},
        join_at={str(i): i % 4 for i in range(10)},
    )
    assert [got[str(i)].choices[0].token_ids for i in range(10)] == expected


def test_a_prefix_cache_hit_on_fp8_pages_is_not_recomputed_and_gives_the_same_tokens(fp8_alone, tiny_model_path):
    engine = make_engine(tiny_model_path, page_size=16, kv_cache_dtype="fp8")
    prefix = random_prompts(1, 48, 48, seed=3)[0]
    run(engine, {"a": (prefix + [11, 12, 13], greedy(4, ignore_eos=True))})
    second = prefix + [21, 22]
    res = run(engine, {"b": (second, greedy(6, ignore_eos=True))})["b"]
    assert res.last.num_cached_tokens == 48
    assert res.choices[0].token_ids == alone(fp8_alone, second, greedy(6, ignore_eos=True))


def test_preempted_forked_choices_on_fp8_pages_give_the_same_tokens(fp8_alone, tiny_model_path):
    # As test_engine's: "g"'s four choices share their prompt's pages (a fork), are preempted by "a" and share
    # them again when they return; a tiny pool preempts the plain requests too.
    prompt = random_prompts(1, 40, 40, seed=14)[0]
    params = SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=8, ignore_eos=True)
    expected = run(fp8_alone, {"g": (prompt, params)})["g"]
    engine = make_engine(
        tiny_model_path,
        page_size=4,
        num_kv_pages=30,
        max_model_len=96,
        enable_prefix_caching=False,
        kv_cache_dtype="fp8",
    )
    got = run(
        engine, {"a": (random_prompts(1, 44, 44, seed=15)[0], greedy(40, ignore_eos=True)), "g": (prompt, params)}
    )
    assert engine.scheduler.num_preemptions > 0
    assert {i: c.token_ids for i, c in got["g"].choices.items()} == {
        i: c.token_ids for i, c in expected.choices.items()
    }
    prompts = random_prompts(6, 8, 14, seed=4)
    want = [alone(fp8_alone, p, greedy(18, ignore_eos=True)) for p in prompts]
    tight = make_engine(tiny_model_path, page_size=4, num_kv_pages=14, max_model_len=40, kv_cache_dtype="fp8")
    got = run(tight, {str(i): (p, greedy(18, ignore_eos=True)) for i, p in enumerate(prompts)})
    assert tight.scheduler.num_preemptions > 0
    assert [got[str(i)].choices[0].token_ids for i in range(6)] == want


def test_window_groups_on_fp8_pages(tiny_window_model_path):
    """Two KV groups (full and a sliding window) on FP8 pages: a prompt longer than the window, batched with
    others, gives the tokens it gives alone."""
    alone_engine = make_engine(tiny_window_model_path, page_size=4, kv_cache_dtype="fp8")
    prompts = random_prompts(4, 5, 30, seed=8)
    expected = [alone(alone_engine, p, greedy(12, ignore_eos=True)) for p in prompts]
    engine = make_engine(tiny_window_model_path, page_size=4, kv_cache_dtype="fp8", num_kv_pages=40)
    got = run(engine, {str(i): (p, greedy(12, ignore_eos=True)) for i, p in enumerate(prompts)})
    assert all(pool.data.dtype == FP8 for pool in engine.pools) and len(engine.pools) == 2
    assert [got[str(i)].choices[0].token_ids for i in range(4)] == expected


# SmolLM2-135M, the continuation below teacher-forced after the France prompt (23 tokens): |logprob(fp8 pages) -
# logprob(float pages)| measured largest 0.28 (mean 0.08) in float32. In bfloat16 it depends on the CPU's bf16
# matmuls: 0.39 (0.10) on one, 0.66 (0.14) under torch 2.13 and 0.90 (0.16) under torch 2.11 on a CPU with AMX,
# all at the same token. The bounds are 1.5x the largest measured in each dtype.
DEFAULT_LOGPROB_MAX = {"float32": 0.6, "bfloat16": 1.35}
DEFAULT_LOGPROB_MEAN = {"float32": 0.16, "bfloat16": 0.24}
FRANCE = "What is the capital of France?"
CONTINUATION = "The capital of France is Paris. It is known for the Eiffel Tower, art museums and its long history."


def chat(engine, question: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_default_model_on_fp8_pages_answers_as_on_float_pages(dtype, baked_model_path):
    """Greedy, 32 tokens: the two closed questions answer as with a float cache in both compute dtypes, except where
    the float cache's top two tokens lie within the stated per-token drift (DEFAULT_LOGPROB_MAX): there FP8 pages
    may pick the other one. France's first token is such a near-tie ("The" against "L"), measured 0.08 apart in
    float32 and 0.19 in bfloat16 on a CPU with AMX, where FP8 pages turn it; the open questions, "Name three
    colours." or a haiku, part after a few tokens the same way (bfloat16 / float32: colours at 4 / same, haiku at
    4 / 1, Romeo and Juliet at 24 / 13)."""
    questions = [FRANCE, "What is 2+2? Answer briefly."]
    answers, tops, logprobs = {}, {}, {}
    for kv in ("auto", "fp8"):
        engine = make_engine(baked_model_path, dtype=dtype, num_kv_pages=128, kv_cache_dtype=kv)
        params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=2)
        got = run(engine, {q: (chat(engine, q), params) for q in questions})
        answers[kv] = {q: got[q].choices[0].token_ids for q in questions}
        tops[kv] = {q: got[q].choices[0].logprobs for q in questions}
        prompt = chat(engine, FRANCE)
        ids = prompt + engine.tokenizer.encode(CONTINUATION, add_special_tokens=False)
        forced = run(engine, {"f": (ids, SamplingParams(max_tokens=1, prompt_logprobs=0))})["f"]
        logprobs[kv] = [p.chosen.logprob for p in forced.first.prompt_logprobs[len(prompt) :]]
    for q in questions:
        ours, want = answers["fp8"][q], answers["auto"][q]
        if ours != want:  # the first token that differs is one of the float cache's near-ties
            i = next(j for j, (a, b) in enumerate(zip(ours, want, strict=False)) if a != b)
            top = {t.token_id: t.logprob for t in tops["auto"][q][i].top}
            assert ours[i] in top and top[want[i]] - top[ours[i]] < DEFAULT_LOGPROB_MAX[dtype], (q, i)
    assert answers["fp8"][questions[1]] == answers["auto"][questions[1]]  # 2+2 has no near-tie
    diffs = [abs(a - b) for a, b in zip(logprobs["fp8"], logprobs["auto"], strict=True)]
    assert max(diffs) < DEFAULT_LOGPROB_MAX[dtype] and sum(diffs) / len(diffs) < DEFAULT_LOGPROB_MEAN[dtype]
