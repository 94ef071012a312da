"""FP8 (e4m3) KV pages on the GPU: FlashInfer's own FP8 KV kernels (kv_data_type float8_e4m3fn, k_scale / v_scale
on run) against the torch reference on the same FP8 pages, eager and under CUDA-graph decode."""

from __future__ import annotations

import pytest
import torch

from engine.attention.kv_quant import FP8
from engine.attention.torch_ref import TorchRefBackend

DT = torch.bfloat16
TOL = 2e-2
STEPS = [
    [("a", 37), ("b", 1), ("c", 16)],
    [("a", 1), ("b", 1), ("c", 1)],
    [("b", 20), ("a", 1)],
    [("a", 1), ("b", 1), ("c", 1)],
    [("a", 1), ("b", 1), ("c", 1)],
]


SLOW = pytest.mark.slow  # each FP8 window / sink variant is another FlashInfer JIT build: opt in with -m slow


@pytest.mark.parametrize("page_size", [16, pytest.param(1, marks=SLOW)])
@pytest.mark.parametrize("window", [None, pytest.param(24, marks=SLOW)])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.5, 2.0)])
@pytest.mark.parametrize("with_sinks", [False, pytest.param(True, marks=SLOW)])
def test_flashinfer_on_fp8_pages_equals_the_torch_reference(gpu_pager, page_size, window, scales, with_sinks):
    from engine.attention.flashinfer import FlashInferBackend

    hq, hk, d = 8, 2, 64
    pager = gpu_pager(num_layers=1, num_kv_heads=hk, head_dim=d, page_size=page_size, dtype=FP8)
    fi = FlashInferBackend(
        device="cuda", num_q_heads=hq, num_kv_heads=hk, head_dim=d, dtype=DT, kv_dtype=FP8, window=window
    )
    ref = TorchRefBackend("cuda", window=window)
    gen = torch.Generator(device="cuda").manual_seed(0)
    sinks = torch.randn(hq, generator=gen, device="cuda") if with_sinks else None
    k_scale, v_scale = scales
    for step in STEPS:
        _, meta = pager.step(step)
        t = sum(n for _, n in step)
        q = torch.randn(t, hq, d, generator=gen, device="cuda").to(DT)
        k = (torch.randn(t, hk, d, generator=gen, device="cuda") * 8).to(DT)
        v = torch.randn(t, hk, d, generator=gen, device="cuda").to(DT)
        outs = []
        for backend, name in ((ref, "ref"), (fi, "test")):
            backend.plan(meta)
            k_cache, v_cache = pager.caches[name][0]
            backend.write_kv(k, v, k_cache, v_cache, k_scale=k_scale, v_scale=v_scale)
            outs.append(backend.run(q, k_cache, v_cache, sinks=sinks, k_scale=k_scale, v_scale=v_scale))
        assert outs[1].dtype == DT and torch.isfinite(outs[1]).all()
        torch.testing.assert_close(outs[1], outs[0], atol=TOL, rtol=TOL)
    assert torch.equal(pager.data["test"].view(torch.uint8), pager.data["ref"].view(torch.uint8))


def test_graph_decode_on_fp8_pages_equals_eager(tmp_path, tiny_llama_checkpoint, gpu_pager):
    from engine.attention.flashinfer import FlashInferBackend
    from engine.core.cuda_graphs import CudaGraphRunner
    from engine.model.loader import load_model

    path = tiny_llama_checkpoint(tmp_path / "model")
    model, spec = load_model(str(path), DT, torch.device("cuda"))
    for layer in model.model.layers:  # checkpoint-style scales: the captured kernels must carry them
        layer.self_attn.k_scale, layer.self_attn.v_scale = 0.5, 0.25
    pager = gpu_pager(
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        dtype=FP8,
        pools=("eager", "graph"),
    )
    shape = dict(
        num_q_heads=spec.num_q_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, dtype=DT, kv_dtype=FP8
    )
    eager = FlashInferBackend(device="cuda", **shape)
    runner = CudaGraphRunner(
        model=model,
        backend=FlashInferBackend(device="cuda", **shape),
        kv_caches=pager.caches["graph"],
        batch_sizes=[1, 2, 4],
        max_pages_per_seq=16,
    )
    runner.capture()
    g = torch.Generator().manual_seed(0)
    tokens = {rid: torch.randint(0, 512, (n,), generator=g).tolist() for rid, n in (("a", 13), ("b", 40), ("c", 7))}
    for batch in ([*tokens], ["a", "b", "c"], ["c", "a"], ["b"]):
        positions, meta = pager.step([(rid, len(tokens[rid])) for rid in batch])
        ids = torch.tensor([t for rid in batch for t in tokens[rid]], device="cuda")
        with torch.inference_mode():
            eager.plan(meta)
            last = meta.qo_indptr[1:].long() - 1
            le = model.compute_logits(model(ids, positions, meta, pager.caches["eager"], eager)[last])
            lg = model.compute_logits(runner(ids, positions, meta)[last])
        torch.testing.assert_close(lg, le, atol=0.15, rtol=0.05)
        tokens = {rid: [int(torch.randint(0, 512, (1,), generator=g))] for rid in tokens}
    assert runner.replays == 3
    used = sorted(pager.used_pages())
    # One e4m3 step apart at most (12.5%): later layers' K and V come from attention outputs that differ in rounding.
    graph, eager_pages = (pager.data[name][:, :, used].float() for name in ("graph", "eager"))
    torch.testing.assert_close(graph, eager_pages, atol=0.1, rtol=0.13)
