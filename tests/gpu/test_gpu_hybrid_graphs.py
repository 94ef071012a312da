"""Hybrid models (Gated DeltaNet + attention) decoding under CUDA graphs: one Gated DeltaNet decode step captured
over a static slot buffer and replayed on other slots equals the eager step; and a tiny random Qwen3.5 served by the
engine with graphs gives the eager engine's tokens, its decode steps replayed, snapshots taken in replayed steps
reused by a second turn from the prefix cache."""

from __future__ import annotations

import torch

from tests.gpu.test_gpu_linear_attention import deltanet, pools

MAX_TOKENS = 24


def test_a_deltanet_decode_step_replays_from_a_graph_on_other_slots():
    from engine.model.layers.recurrent_step import RecurrentStep

    layer, scratch = deltanet(torch.bfloat16), 9
    conv, state = pools(10, torch.bfloat16)
    x = torch.zeros(4, 128, device="cuda", dtype=torch.bfloat16)  # static, as the graph runner's buffers
    index = torch.full((4,), scratch, device="cuda")
    step = RecurrentStep.graphed(index)
    with torch.inference_mode():
        for _ in range(2):  # warm-up outside the graph: Triton builds
            layer(x, step, conv, state)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x, step, conv, state)
        want_conv, want_state = conv.clone(), state.clone()
        gen = torch.Generator(device="cuda").manual_seed(3)
        for slots in ([2, 7, 0], [0, 1, 2, 3], [5]):
            rows = torch.randn(len(slots), 128, device="cuda", generator=gen).to(torch.bfloat16)
            want = layer(rows, RecurrentStep.graphed(torch.tensor(slots, device="cuda")), want_conv, want_state)
            x[: len(slots)].copy_(rows)
            index[: len(slots)].copy_(torch.tensor(slots))
            index[len(slots) :].fill_(scratch)  # padding rows: the scratch slot
            graph.replay()
            torch.testing.assert_close(out[: len(slots)], want, atol=0, rtol=0)
    held = list(range(scratch))
    assert torch.equal(conv[held], want_conv[held]) and torch.equal(state[held], want_state[held])


def hybrid_checkpoint(path):
    """A tiny random Qwen3.5: three Gated DeltaNet layers of test_gpu_linear_attention's heads (fla's autotuned
    prefill kernel already tuned for them), one attention layer of 8 q / 2 kv heads of 64."""
    from bench.gpu.random_model import save_word_tokenizer
    from tests.engine.model.hybrid_checkpoints import build_hybrid_checkpoint
    from tests.gpu.test_gpu_linear_attention import DK, DV, HK, HV

    build_hybrid_checkpoint(
        "qwen3_5_text",
        path,
        head_dim=64,
        num_attention_heads=8,
        num_key_value_heads=2,
        linear_num_key_heads=HK,
        linear_num_value_heads=HV,
        linear_key_head_dim=DK,
        linear_value_head_dim=DV,
    )
    save_word_tokenizer(path, 128)
    return path


def serve(path, enforce_eager: bool) -> tuple[dict, dict, int]:
    """Five prompts' greedy tokens, then a second turn of each (prompt, answer and 5 more tokens): both turns'
    tokens and the second turn's cached prompt tokens; the graph runner's replays."""
    from engine.config import EngineConfig
    from engine.core.engine import LLMEngine
    from engine.sample.params import SamplingParams
    from tests.engine.core.engine_run import run

    engine = LLMEngine(
        EngineConfig(
            model_path=str(path),
            device="cuda",
            dtype="bfloat16",
            attention_backend="flashinfer",
            num_kv_pages=512,
            page_size=16,
            max_num_seqs=8,
            enforce_eager=enforce_eager,
        )
    )
    assert (engine.runner.graph_runner is None) == enforce_eager
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    prompts = {f"p{n}": torch.randint(3, 128, (n,), generator=gen).tolist() for n in (3, 17, 40, 9, 33)}
    first = {
        r: got.choices[0].token_ids for r, got in run(engine, {r: (p, params) for r, p in prompts.items()}).items()
    }
    turn2 = {r: (p + first[r] + [5, 6, 7, 8, 9], params) for r, p in prompts.items()}
    second = run(engine, turn2)
    cached = {r: got.last.num_cached_tokens for r, got in second.items()}
    graphs = engine.runner.graph_runner
    if graphs is not None:
        assert graphs.eager_fallbacks == 0
    return (
        first,
        {r: (got.choices[0].token_ids, cached[r]) for r, got in second.items()},
        (graphs.replays if graphs is not None else 0),
    )


def test_a_hybrid_model_decodes_under_cuda_graphs_as_eagerly(tmp_path):
    path = hybrid_checkpoint(tmp_path / "qwen3_5")
    eager_first, eager_second, eager_replays = serve(path, enforce_eager=True)
    first, second, replays = serve(path, enforce_eager=False)
    assert eager_replays == 0 and replays > 0, "decode steps did not replay CUDA graphs"
    assert first == eager_first
    assert second == eager_second
    # Each second turn's prompt hit the cache past its first prompt: at a snapshot a replayed decode step took.
    for r, (_, cached) in second.items():
        assert cached > int(r[1:]) and cached % 16 == 0, (r, cached)
