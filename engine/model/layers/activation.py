"""The MLP activations in torch (engine.cuda.kernels has FlashInfer's fused SwiGLU)."""

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


def clamped_swiglu(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation on its fused gate_up output, gate and up interleaved (gate at even columns):
    (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""
    gate, up = x[..., ::2].clamp(max=limit), x[..., 1::2].clamp(-limit, limit)
    return (up + 1).mul_(gate * torch.sigmoid(gate * alpha))


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 (transformers' relu2): Nemotron-H's non-gated MLP and experts."""
    return F.relu(x).square()
