"""Fp8Linear's arithmetic (FP8 weights kept in FP8, activations quantised on the fly, torch._scaled_mm), run here
through torch's CPU _scaled_mm against the float32 product of the dequantised weight. The product path serves it
on CUDA GPUs with FP8 tensor cores only (tests/gpu/test_gpu_quant.py); on CPU FP8 weights are dequantised."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.model.quant.fp8_linear import FP8, Fp8Linear
from tests.engine.model.quant_writers import fp8_stacked_linear

SIZES = {"q_proj": 128, "k_proj": 32, "v_proj": 32}


def _cpu_scaled_mm_takes_row_scales() -> bool:
    """torch 2.13's CPU _scaled_mm takes a scale per row; 2.11's (the image's) only one per tensor."""
    a, b = torch.ones(16, 16, dtype=FP8), torch.ones(16, 16, dtype=FP8).t()
    try:
        torch._scaled_mm(a, b, scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("strategy", ["tensor", "channel"])
@pytest.mark.parametrize("row_wise", [False, True])  # per-tensor activation scale (Ada) / per token (Hopper+)
def test_fp8_linear_matches_the_dequantised_weight(strategy, row_wise):
    if row_wise and not _cpu_scaled_mm_takes_row_scales():
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm has no per-row scales (the GPU test covers them)")
    fmt, linear = fp8_stacked_linear(strategy, SIZES, 256)
    bias = torch.randn(linear.out_features)
    module = Fp8Linear(
        weight=linear.weight.detach(),
        row_scale=fmt.row_scale(linear),
        bias=bias,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
        row_wise=row_wise,
    )
    assert module.weight.dtype == FP8 and module.weight.data_ptr() != 0
    x = torch.randn(2, 7, 256)
    x[0, 3] *= 30  # one loud token: e4m3's exponent keeps the quiet ones' relative precision at either scaling
    expected = x @ fmt.dequantize(linear).t() + bias
    got = module(x.bfloat16()).float()
    assert got.shape == expected.shape
    error = float((got - expected).norm() / expected.norm())
    # e4m3 activations carry 3 mantissa bits: measured 0.028 for all four cases, 0.016 on the quiet row alone.
    assert error < 0.04
    assert float((got[1] - expected[1]).norm() / expected[1].norm()) < 0.03


def test_fp8_weights_are_dequantised_on_cpu():
    fmt, linear = fp8_stacked_linear("channel", SIZES, 256)
    module = fmt.serving_module(linear, torch.float32, torch.device("cpu"))
    assert type(module) is nn.Linear and module.weight.dtype == torch.float32
    torch.testing.assert_close(module.weight, fmt.dequantize(linear))
