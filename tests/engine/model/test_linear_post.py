"""A linear and the step after it (engine/model/layers/linear_post.py): on a packed bf16 linear the step fused into
the oneDNN call equals the float32 math on the same bf16 weights within one bf16 rounding of the result, on a plain
linear it is the torch expression itself, and neither touches the tensor it reads besides x."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.model.layers.linear import PackedLinear
from engine.model.layers.linear_post import linear_add, linear_gelu, linear_mul

PACKS = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _case(bias: bool):
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias).to(torch.bfloat16).requires_grad_(False)
    x = (5 * torch.randn(37, 96)).to(torch.bfloat16)  # pre-activations of a few units: where the GELUs differ
    other = torch.randn(37, 160).to(torch.bfloat16)
    exact = F.linear(x.float(), linear.weight.float(), None if linear.bias is None else linear.bias.float())
    return linear, x, other, exact


STEPS = {
    "gelu_tanh": (lambda lin, x, o: linear_gelu(lin, x, "tanh"), lambda y, o: F.gelu(y, approximate="tanh")),
    "gelu": (lambda lin, x, o: linear_gelu(lin, x, "none"), lambda y, o: F.gelu(y)),
    "mul": (lambda lin, x, o: linear_mul(lin, x, o), lambda y, o: y * o.float()),
    "add": (lambda lin, x, o: linear_add(lin, x, o), lambda y, o: y + o.float()),
}


@pytest.mark.skipif(not PACKS, reason="this CPU has no bf16 oneDNN: nothing is packed")
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("step", list(STEPS))
def test_the_fused_step_equals_the_float32_math_within_one_rounding(step, bias):
    linear, x, other, exact = _case(bias)
    kept = other.clone()
    fused, math = STEPS[step]
    got = fused(PackedLinear(linear), x, other)
    want = math(exact, other)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # one rounding to bfloat16 (8 bits of mantissa) of the float32 result, and no more
    assert ((got.float() - want).abs() <= want.abs() * 2**-8 + 1e-5).all()
    assert torch.equal(other, kept)


@pytest.mark.parametrize("step", list(STEPS))
def test_a_plain_linear_runs_the_torch_expression(step):
    linear, x, other, _ = _case(True)
    linear, x, other = linear.float(), x.float(), other.float()
    fused, math = STEPS[step]
    torch.testing.assert_close(fused(linear, x, other), math(linear(x), other), atol=0, rtol=0)
