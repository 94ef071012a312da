"""engine.model.layers.logits on CUDA: a bf16 head's refined logits equal the same refinement on the CPU, and the
greedy token is the float32 argmax (cuBLAS rounds bf16 outputs as the CPU does)."""

from __future__ import annotations

import torch

from engine.model.layers.logits import refine_near_max


def test_refined_cuda_logits_match_the_cpu_and_the_float32_argmax():
    gen = torch.Generator().manual_seed(0)
    weight = (0.05 * torch.randn(4096, 256, generator=gen)).to(torch.bfloat16)
    hidden = torch.randn(8, 256, generator=gen).to(torch.bfloat16)
    cpu = refine_near_max(hidden @ weight.T, hidden, weight)
    w, h = weight.cuda(), hidden.cuda()
    rows = torch.arange(8, device="cuda")
    cuda = refine_near_max(h @ w.T, h, w, rows)
    exact = h.float() @ w.float().T
    assert torch.equal(cuda.argmax(-1), exact.argmax(-1))
    torch.testing.assert_close(cuda.cpu(), cpu, atol=0.07, rtol=0)  # bf16 rounding away from the maximum
