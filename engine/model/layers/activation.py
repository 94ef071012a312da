"""The gated MLP's activation in torch (engine.cuda.kernels has FlashInfer's fused one)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused gate_up projection: silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU on a fused gate_up projection: gelu_pytorch_tanh(gate) * up (Gemma's hidden_activation)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)
