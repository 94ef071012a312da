"""A linear and the elementwise step that follows it (a GELU, times or plus another tensor) as one oneDNN call, the
step fused as a post-op on the accumulator, where the linear is a PackedLinear (a bf16 CPU); plain torch otherwise.

NOTE: on a bf16 CPU a tanh GELU over a tower's MLP width costs about three times its matmul, and as a post-op about
one matmul; the fused step also rounds to bfloat16 once, after it, not before it too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.layers.linear import PackedLinear


def linear_gelu(linear: nn.Module, x: torch.Tensor, approximate: str) -> torch.Tensor:
    """gelu(linear(x)); approximate as F.gelu's ("tanh" or "none")."""
    if isinstance(linear, PackedLinear):
        return torch.ops.mkldnn._linear_pointwise(x, linear.packed, linear.bias, "gelu", [], approximate)
    return F.gelu(linear(x), approximate=approximate)


def linear_mul(linear: nn.Module, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """linear(x) * other (a gated MLP's up projection times its activated gate)."""
    if isinstance(linear, PackedLinear):
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, linear.packed, linear.bias, "mul")
    return linear(x) * other


def linear_add(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + linear(x), a new tensor (a pre-norm block's residual step)."""
    if isinstance(linear, PackedLinear):
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, linear.packed, linear.bias, "add")
    return residual + linear(x)
