"""MXFP4 experts kept packed on CUDA (engine/model/quant/mxfp4_packed.py) against the same experts dequantised once
and run by the stacked path, in bfloat16 with gpt-oss's biases: a decode-sized step (gathered pairs), larger steps
(every expert, whole or a few at a time), and the decode step captured in a CUDA graph and replayed on new
routing."""

from __future__ import annotations

import pytest
import torch

from engine.model.layers.moe import StackedExperts, grouped_mm_runs
from engine.model.quant import mxfp4_packed
from engine.model.quant.mxfp4 import dequantize_mxfp4
from engine.model.quant.mxfp4_packed import PackedMxfp4
from tests.gpu.conftest import replay_experts_on_new_routing

DT = torch.bfloat16
E, H, INTER = 8, 256, 128


def pair(scratch: int | None = None) -> tuple[StackedExperts, StackedExperts]:
    """(packed, dequantised) experts over the same random MXFP4 codes and biases."""
    gen = torch.Generator().manual_seed(0)
    packed = StackedExperts(num_experts=E, hidden_size=H, intermediate_size=INTER, bias=True).to("cuda", DT)
    plain = StackedExperts(num_experts=E, hidden_size=H, intermediate_size=INTER, bias=True).to("cuda", DT)
    for proj, (rows, cols) in (("gate_up_proj", (2 * INTER, H)), ("down_proj", (H, INTER))):
        blocks = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=gen, dtype=torch.uint8).cuda()
        scales = torch.randint(120, 124, (E, rows, cols // 32), generator=gen, dtype=torch.uint8).cuda()
        delattr(packed, proj)
        packed.register_parameter(f"{proj}_blocks", torch.nn.Parameter(blocks, requires_grad=False))
        packed.register_parameter(f"{proj}_scales", torch.nn.Parameter(scales, requires_grad=False))
        getattr(plain, proj).data.copy_(dequantize_mxfp4(blocks, scales, DT))
        bias = torch.randn(E, rows, generator=gen).to("cuda", DT) * 0.1
        getattr(packed, f"{proj}_bias").data.copy_(bias)
        getattr(plain, f"{proj}_bias").data.copy_(bias)
    saved = mxfp4_packed.SCRATCH_BYTES
    mxfp4_packed.SCRATCH_BYTES = scratch or saved
    try:
        packed.runner = PackedMxfp4(packed, DT)
    finally:
        mxfp4_packed.SCRATCH_BYTES = saved
    return packed, plain


def routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    weights, ids = torch.randn(tokens, E, device="cuda", generator=gen).softmax(-1).topk(2, dim=-1)
    return ids, weights.to(DT)


@pytest.mark.parametrize("scratch", [None, 1], ids=["whole layer", "one expert at a time"])
@pytest.mark.parametrize("tokens", [1, 3, 64, 300])
def test_packed_experts_match_the_dequantised_ones(tokens, scratch):
    packed, plain = pair(scratch)
    x = torch.randn(tokens, H, device="cuda", dtype=DT)
    ids, weights = routing(tokens, 1)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x, ids, weights), plain(x, ids, weights), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("tokens", [2, 16])
def test_packed_experts_replay_in_a_cuda_graph(tokens):
    if not grouped_mm_runs(torch.device("cuda"), DT):
        pytest.skip("torch._grouped_mm needs sm90 or later for bfloat16")
    packed, plain = pair(1)
    assert packed.capture_blocker(torch.device("cuda"), DT) is None
    x = torch.randn(tokens, H, device="cuda", dtype=DT)
    ids, weights = routing(tokens, 2)
    out = replay_experts_on_new_routing(packed, x, ids, weights, *routing(tokens, 3))
    with torch.inference_mode():
        torch.testing.assert_close(out, plain(x, ids, weights), atol=3e-2, rtol=3e-2)
