"""FlashInfer backend against the torch reference backend on identical metadata, on the GPU."""

from __future__ import annotations

import pytest
import torch

from engine.attention.torch_ref import TorchRefBackend

TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


def run_steps(
    pager,
    steps,
    num_q_heads: int,
    *,
    shape_known: bool = True,
    shares=(),
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    **extras: float,
) -> None:
    """Each step: (request, new tokens). Both backends write their own pool and attend; outputs and pools
    must agree. shares: (before step index, src, dst, pages) prefix-cache hits applied before that step.
    window: both backends attend through a sliding window of that many tokens; sinks: each layer's sink logits;
    extras: scale, soft_cap."""
    from engine.attention.flashinfer import FlashInferBackend

    gen = torch.Generator(device="cuda").manual_seed(0)
    hk, d, dtype = pager.num_kv_heads, pager.head_dim, pager.dtype
    kw = dict(num_q_heads=num_q_heads, num_kv_heads=hk, head_dim=d, dtype=dtype) if shape_known else {}
    fi = FlashInferBackend(device="cuda", window=window, **extras, **kw)
    ref = TorchRefBackend("cuda", window=window, **extras)
    for index, step in enumerate(steps):
        for at, src, dst, pages in shares:
            if at == index:
                pager.share(src, dst, pages)
        _, meta = pager.step(step)
        t = sum(n for _, n in step)
        for layer in range(pager.num_layers):
            q = torch.randn(t, num_q_heads, d, generator=gen, device="cuda").to(dtype)
            k = torch.randn(t, hk, d, generator=gen, device="cuda").to(dtype)
            v = torch.randn(t, hk, d, generator=gen, device="cuda").to(dtype)
            outs = []
            for backend, name in ((ref, "ref"), (fi, "test")):
                if layer == 0:
                    backend.plan(meta)
                k_cache, v_cache = pager.caches[name][layer]
                backend.write_kv(k, v, k_cache, v_cache)
                outs.append(backend.run(q, k_cache, v_cache, sinks=sinks))
            assert outs[1].shape == q.shape and outs[1].dtype == dtype
            assert torch.isfinite(outs[1]).all()
            tol = TOL[dtype]
            torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)
    assert torch.equal(pager.data["test"], pager.data["ref"]), "write_kv stored different K/V"


@pytest.mark.parametrize("page_size", [1, 16])
# float16 builds a second set of kernels (about a minute of JIT): opt in with -m slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.slow)])
def test_prefill_then_decode(gpu_pager, page_size, dtype):
    pager = gpu_pager(num_layers=2, num_kv_heads=2, head_dim=64, page_size=page_size, dtype=dtype)
    steps = [[("a", 37), ("b", 1), ("c", 16)]] + [[("a", 1), ("b", 1), ("c", 1)]] * 4
    run_steps(pager, steps, num_q_heads=8)


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (9, 3), (8, 2), (14, 2), (32, 8)])
def test_gqa_ratios_both_decode_kernels(gpu_pager, num_q_heads, num_kv_heads):
    # ratios 1 and 3 take the CUDA-core decode kernel, 4 and up the tensor-core one
    head_dim = 128 if num_q_heads == 32 else 64
    pager = gpu_pager(num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=16)
    steps = [[("a", 50), ("b", 3)]] + [[("a", 1), ("b", 1)]] * 3
    run_steps(pager, steps, num_q_heads=num_q_heads)


def test_mixed_steps_chunked_prefill_with_decode_rows(gpu_pager):
    pager = gpu_pager(num_layers=1, num_kv_heads=2, head_dim=64, page_size=16)
    steps = [
        [("a", 40), ("b", 17)],
        [("b", 1), ("a", 33), ("c", 5), ("d", 1)],  # decode rows, a chunk on cached KV, fresh prompts
        [("c", 1), ("a", 1), ("d", 70), ("b", 1)],
        [("a", 1), ("b", 1), ("c", 1), ("d", 1)],
    ]
    run_steps(pager, steps, num_q_heads=8)


def test_partly_filled_last_pages(gpu_pager):
    # every length modulo the page size, so last_page_len runs through 1..16
    pager = gpu_pager(num_layers=1, num_kv_heads=2, head_dim=64, page_size=16)
    first = [(f"r{i}", 16 + i) for i in range(1, 17)]
    steps = [first] + [[(rid, 1) for rid, _ in first]] * 2
    run_steps(pager, steps, num_q_heads=8)


def test_shared_prefix_pages(gpu_pager):
    # b and c reuse a's first two full pages (prefix cache) and prefill only their own suffix
    pager = gpu_pager(num_layers=2, num_kv_heads=2, head_dim=64, page_size=16)
    steps = [
        [("a", 40)],
        [("b", 9), ("c", 1), ("a", 1)],
        [("b", 1), ("c", 1), ("a", 1)],
        [("b", 1), ("c", 1), ("a", 1)],
    ]
    run_steps(pager, steps, num_q_heads=8, shares=[(1, "a", "b", 2), (1, "a", "c", 2)])
    assert pager.pages["b"][:2] == pager.pages["a"][:2] == pager.pages["c"][:2]


def test_shape_learned_from_first_run(gpu_pager):
    # create_backend("flashinfer", device) without head counts: the first run() of a step plans
    pager = gpu_pager(num_layers=2, num_kv_heads=2, head_dim=64, page_size=16)
    run_steps(pager, [[("a", 20), ("b", 5)], [("a", 1), ("b", 1)]], num_q_heads=8, shape_known=False)


def test_float32_is_refused_with_a_clear_error():
    from engine.attention.flashinfer import FlashInferBackend

    with pytest.raises(ValueError, match="float16 or bfloat16"):
        FlashInferBackend(device="cuda", num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float32)


def test_registry_creates_flashinfer_on_cuda():
    from engine.attention import create_backend
    from engine.attention.flashinfer import FlashInferBackend

    assert isinstance(create_backend("flashinfer", "cuda"), FlashInferBackend)


def test_warmup_runs_prefill_and_decode():
    from engine.attention.flashinfer import FlashInferBackend

    backend = FlashInferBackend(device="cuda", num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    backend.warmup(page_size=16)
    assert backend._decode, "warm-up did not build the decode wrapper"


@pytest.mark.parametrize("window", [1, 24, 40])
def test_sliding_window_matches_reference(gpu_pager, window):
    # FlashInfer's window_left = W - 1 against the torch reference's window, prefill chunks and decode past it.
    pager = gpu_pager(num_layers=1, num_kv_heads=2, head_dim=64, page_size=16)
    steps = [[("a", 50), ("b", 3)], [("b", 30), ("a", 1), ("c", 7)]] + [[("a", 1), ("b", 1), ("c", 1)]] * 3
    run_steps(pager, steps, num_q_heads=8, window=window)


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(8, 2, 64), (12, 4, 128)])
def test_sinks_match_reference(gpu_pager, window, num_q_heads, num_kv_heads, head_dim):
    # FlashInfer's attention-sink variant (prefill and decode steps) against the torch reference's sink key,
    # gpt-oss's head size 64 among them; sinks large enough to take a visible share of the softmax.
    pager = gpu_pager(num_layers=2, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=16)
    sinks = torch.linspace(-2.0, 6.0, num_q_heads, device="cuda")
    steps = [[("a", 60), ("b", 3)], [("b", 1), ("a", 33), ("c", 5)]] + [[("a", 1), ("b", 1), ("c", 1)]] * 30
    run_steps(pager, steps, num_q_heads=num_q_heads, window=window, sinks=sinks)


@pytest.mark.parametrize(("num_q_heads", "window", "head_dim"), [(4, None, 256), (8, 24, 256), (16, None, 256)])
def test_gemma_scale_and_soft_cap_match_reference(gpu_pager, num_q_heads, window, head_dim):
    # Gemma's extras on plan(): sm_scale (query_pre_attn_scalar) and logits_soft_cap, on both decode kernels
    # (GQA 2 and 8), with and without a window. Gemma 4's global head size, 512, has no FlashInfer 0.5.3 kernel: its
    # group runs on the torch backend (test_gpu_group_backends.py).
    pager = gpu_pager(num_layers=1, num_kv_heads=2, head_dim=head_dim, page_size=16)
    steps = [[("a", 50), ("b", 3)], [("b", 30), ("a", 1), ("c", 7)]] + [[("a", 1), ("b", 1), ("c", 1)]] * 3
    run_steps(pager, steps, num_q_heads=num_q_heads, window=window, scale=0.5, soft_cap=3.0)
