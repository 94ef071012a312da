"""FP8 weights kept in FP8 on CUDA GPUs with FP8 tensor cores (compute capability 8.9 and up: Ada, Hopper,
Blackwell), multiplied by torch._scaled_mm against activations quantised to FP8 on the fly.

Activations get a dynamic scale (amax / 448) each call, per token on Hopper and later (_scaled_mm's row-wise
scaling, sm90+), per tensor on Ada; the checkpoint's static input_scale is not used (dynamic is at least as
accurate). Weight scales per tensor (one per stacked matrix) or per output channel; block-wise (128 x 128) scales
stay dequantised to the serving dtype, as on older GPUs.
"""

from __future__ import annotations

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
MIN_SCALE = 1e-12  # an all-zero activation must not divide by zero


def has_fp8_matmul(device: torch.device) -> bool:
    """Whether `device` is a CUDA GPU whose tensor cores multiply FP8 (compute capability >= 8.9)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def row_wise_scaling(device: torch.device) -> bool:
    """_scaled_mm's per-row (per-token x per-channel) scales run on sm90 and later."""
    return torch.cuda.get_device_capability(device) >= (9, 0)


class Fp8Linear(nn.Module):
    """y = (x / sx) @ (w / sw)^T * sx * sw with x / sx and w / sw in e4m3: `weight` [out, in] FP8 as the checkpoint
    stores it, `row_scale` its scale per output row."""

    def __init__(
        self,
        *,
        weight: torch.Tensor,
        row_scale: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        device: torch.device,
        row_wise: bool | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = dtype
        # NOTE: row-wise _scaled_mm writes bfloat16 only.
        self.row_wise = (row_wise_scaling(device) and dtype == torch.bfloat16) if row_wise is None else row_wise
        # NOTE: the serving-dtype scale is registered first: LoRA sizes its buffers from a module's first
        # floating tensor, and FP8 counts as one.
        self.register_buffer("row_scale", row_scale.reshape(-1).to(device, dtype))
        self.register_buffer("row_scale_f32", row_scale.reshape(1, -1).to(device, torch.float32))
        self.register_buffer("unit_scale", torch.ones((), device=device))  # a fixed tensor: CUDA graphs capture it
        # _scaled_mm takes its second operand column-major: the [out, in] row-major weight, transposed.
        self.register_buffer("weight", weight.to(device).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.to(device, dtype), requires_grad=False)

    @staticmethod
    def fits(weight_shape: tuple[int, int], device: torch.device, dtype: torch.dtype) -> bool:
        out, k = weight_shape
        return has_fp8_matmul(device) and dtype in (torch.bfloat16, torch.float16) and out % 16 == 0 and k % 16 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        amax = x.abs().amax(-1, keepdim=True) if self.row_wise else x.abs().amax()
        sx = (amax.float() / FP8_MAX).clamp_(min=MIN_SCALE)
        xq = (x.float() / sx).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
        if self.row_wise:
            y = torch._scaled_mm(xq, mat2=self.weight.t(), scale_a=sx, scale_b=self.row_scale_f32, out_dtype=self.dtype)
        else:
            y = torch._scaled_mm(xq, mat2=self.weight.t(), scale_a=sx, scale_b=self.unit_scale, out_dtype=self.dtype)
            y = y * self.row_scale
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)
