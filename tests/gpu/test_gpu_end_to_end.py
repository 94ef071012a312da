"""The whole CUDA engine path (FlashInfer, bf16, continuous batching) against transformers greedy decoding.

Tokens must match transformers until a position where transformers' own top-2 logits are within a
near-tie, where bf16 rounding legitimately decides; the token chosen there must be transformers' runner-up.
"""

from __future__ import annotations

import pytest
import torch

MAX_TOKENS = 24
NEAR_TIE = 0.25  # logits; bf16 kernels differ from transformers' by a few hundredths


def engine_greedy(model_path, prompts: list[list[int]], **config) -> list[list[int]]:
    return engine_run(model_path, prompts, **config)[0]


def engine_run(model_path, prompts: list[list[int]], **config) -> tuple[list[list[int]], int]:
    """Greedy tokens per prompt, and how many steps replayed a CUDA graph."""
    from engine.config import EngineConfig
    from engine.core.engine import LLMEngine
    from engine.sample.params import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model_path=str(model_path),
            device="cuda",
            dtype="bfloat16",
            attention_backend="flashinfer",
            num_kv_pages=1024,
            **config,
        )
    )
    assert engine.describe()["backend"] == "FlashInferBackend"
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for output in engine.step():
            for delta in output.outputs:
                out[output.request_id] += delta.token_ids
    graphs = getattr(engine.runner, "graph_runner", None)
    replays = graphs.replays if graphs is not None else 0
    del engine
    torch.cuda.empty_cache()
    return [out[str(i)] for i in range(len(prompts))], replays


def hf_greedy(model_path, prompts: list[list[int]]) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' greedy tokens and raw logits [steps, vocab] per prompt (bf16, its default attention)."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.bfloat16).cuda().eval()
    results = []
    for prompt in prompts:  # one at a time: no padding in the reference
        out = model.generate(
            torch.tensor([prompt], device="cuda"),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        results.append((out.sequences[0, len(prompt) :].tolist(), torch.stack([s[0].float() for s in out.logits])))
    del model
    torch.cuda.empty_cache()
    return results


def assert_matches_reference(ours: list[int], ref: list[int], ref_logits: torch.Tensor) -> int:
    """Returns how many leading tokens agree; a divergence must be a near-tie of the reference."""
    for j, (a, b) in enumerate(zip(ours, ref, strict=False)):
        if a != b:
            top = ref_logits[j].topk(2)
            margin = float(top.values[0] - top.values[1])
            assert margin < NEAR_TIE and a == int(top.indices[1]), (
                f"token {j}: ours {a}, transformers {b} (its top-2 {top.indices.tolist()}, margin {margin:.3f})"
            )
            return j
    assert len(ours) == len(ref) == MAX_TOKENS
    return len(ours)


def prompts_for(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 17, 40, 70, 9, 33)]


@pytest.fixture(params=["llama_gqa4", "qwen2_gqa3", "baked"])
def model_path(request, tmp_path_factory, tiny_llama_checkpoint):
    if request.param == "baked":
        return request.getfixturevalue("baked_model_path")
    heads = (8, 2) if request.param == "llama_gqa4" else (6, 2)  # tensor-core / CUDA-core decode
    kind = request.param.split("_")[0]
    return tiny_llama_checkpoint(
        tmp_path_factory.mktemp(request.param), kind=kind, num_q_heads=heads[0], num_kv_heads=heads[1], layers=4
    )


def test_greedy_tokens_equal_transformers(model_path):
    from transformers import AutoConfig

    prompts = prompts_for(AutoConfig.from_pretrained(str(model_path)).vocab_size)
    ours = engine_greedy(model_path, prompts)
    agreed = 0
    for tokens, (ref, logits) in zip(ours, hf_greedy(model_path, prompts), strict=True):
        agreed += assert_matches_reference(tokens, ref, logits)
    assert agreed >= len(prompts) * MAX_TOKENS // 2, f"only {agreed} tokens agreed before near-ties"


def test_cuda_graphs_give_the_same_tokens_as_eager(tmp_path, tiny_llama_checkpoint):
    path = tiny_llama_checkpoint(tmp_path / "m", num_q_heads=8, num_kv_heads=2, layers=4)
    prompts = prompts_for(512)
    eager, eager_replays = engine_run(path, prompts, enforce_eager=True)
    graphed, replays = engine_run(path, prompts, enforce_eager=False)
    assert eager_replays == 0
    # the engine keeps its CudaGraphRunner as engine.runner.graph_runner (None under enforce_eager)
    assert replays > 0, "decode steps did not run under CUDA graphs (engine.runner.graph_runner)"
    assert graphed == eager
