"""Gemma 3's image attention on the GPU: FlashInfer's prefill with the bidirectional image spans as a custom mask
(the sliding window folded in) against the torch reference on identical metadata, and the SigLIP tower and
projector run by torch on CUDA in bfloat16 against the same weights in float32 on the CPU."""

from __future__ import annotations

import pytest
import torch

from engine.attention.torch_ref import TorchRefBackend

TOL = 2e-2


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_with_image_spans_matches_the_reference(gpu_pager, window, page_size):
    """Two requests, one with two image spans (one wider than the window) and a chunk that starts inside a span,
    then decode steps (no mask) on the same pages."""
    from engine.attention.flashinfer import FlashInferBackend

    pager = gpu_pager(num_layers=1, num_kv_heads=2, head_dim=64, page_size=page_size, dtype=torch.bfloat16)
    hq, hk, d = 8, 2, 64
    fi = FlashInferBackend(
        device="cuda", window=window, num_q_heads=hq, num_kv_heads=hk, head_dim=d, dtype=torch.bfloat16
    )
    ref = TorchRefBackend("cuda", window=window)
    steps = [
        ([("a", 40), ("b", 20)], [[(3, 19), (22, 34)], [(2, 6)]]),
        ([("a", 10), ("b", 12)], [[(45, 50)], [(18, 32)]]),  # b's chunk starts inside its span
        ([("a", 1), ("b", 1)], None),
    ]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for step, spans in steps:
        _, meta = pager.step(step)
        meta.bidirectional = spans
        t = sum(n for _, n in step)
        q = torch.randn(t, hq, d, generator=gen, device="cuda").to(torch.bfloat16)
        k = torch.randn(t, hk, d, generator=gen, device="cuda").to(torch.bfloat16)
        v = torch.randn(t, hk, d, generator=gen, device="cuda").to(torch.bfloat16)
        outs = []
        for backend, name in ((ref, "ref"), (fi, "test")):
            backend.plan(meta)
            k_cache, v_cache = pager.caches[name][0]
            backend.write_kv(k, v, k_cache, v_cache)
            outs.append(backend.run(q, k_cache, v_cache))
        torch.testing.assert_close(outs[1], outs[0], atol=TOL, rtol=TOL)


def test_the_vision_tower_on_cuda_matches_the_cpu(tmp_path, baked_model_path):
    from engine.model.loader import load_model
    from tests.engine.model.vision_checkpoints import build_vision_model, gpu_files, hf_pixels

    build_vision_model(tmp_path, baked_model_path)
    cpu, _ = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    gpu, _ = load_model(str(tmp_path), torch.bfloat16, torch.device("cuda"))
    pixels = hf_pixels(gpu_files())
    want = torch.stack(cpu.encode_images(list(pixels), [None] * len(pixels)))
    got = torch.stack(gpu.encode_images(list(pixels.cuda()), [None] * len(pixels))).float().cpu()
    torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)
