"""RMSNorm computed as transformers does, switched to FlashInfer's fused kernels on CUDA (engine.cuda.kernels);
Gemma's RMSNorm; LayerNorm for the decoders that use it in RMSNorm's place."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.cuda import kernels


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 like transformers, optionally fused with the residual add.

    `fused` (set once by the model on CUDA) routes both methods to FlashInfer's kernels.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return kernels.rmsnorm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # transformers: normalise in float32, cast back, then scale in the model dtype. F.rms_norm on a half
        # input computes in float32 and rounds once: bit-identical to that math, in fewer ops.
        return self.weight * F.rms_norm(x, (x.shape[-1],), None, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual): the pre-norm decoder's residual stream step.

        Both inputs may be overwritten (they are step-local activations)."""
        if self.fused:
            return kernels.fused_add_rmsnorm(x, residual, self.weight, self.eps)
        residual = x.add_(residual)
        return self.forward(residual), residual


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the whole norm, its scale included, is computed in float32 and cast back once (unlike
    RMSNorm above, which scales in the model dtype). Gemma 2 / 3 store the weight as an offset from 1 (scale
    1 + w); Gemma 4 stores the scale itself (unit_offset=False), and has norms with no weight (scaled=False)."""

    def __init__(self, dim: int, eps: float, *, unit_offset: bool = True, scaled: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim)) if scaled else None
        self.eps = eps
        self.offset = 1.0 if unit_offset else 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: the same float32 math in place on one new tensor: on a CPU each fresh activation-sized tensor costs
        # page faults as well as a pass (a vision tower's per-head norms ran 2.5x faster so).
        x32 = x.float()
        scale = torch.rsqrt(x32.square().mean(-1, keepdim=True).add_(self.eps))
        normed = x32 * scale if x32 is x else x32.mul_(scale)
        if self.weight is not None:
            normed.mul_(self.offset + self.weight.float())
        return normed.to(x.dtype)


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias (Phi-3.5-MoE's norms), with RMSNorm's interface for the pre-norm decoder:
    forward and add_forward, computed as torch's layer_norm in the input's dtype, as transformers does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual); x may be overwritten."""
        residual = x.add_(residual)
        return self.forward(residual), residual
