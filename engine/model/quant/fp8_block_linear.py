"""Block-wise FP8 weights (128 x 128 scales: Qwen3-FP8, DeepSeek) kept in FP8 on Hopper, multiplied by cuBLAS's
block-scaled GEMM through torch.nn.functional.scaled_mm: activations quantised per token and per 128 columns
(BlockWise1x128, amax / 448), the weight's own 128 x 128 scales (BlockWise128x128).

cuBLAS wants the activation scales token-major with the token count a multiple of 4 (rows are zero-padded) and
the weight scales K-major with their K blocks a multiple of 4 (padded once, at load). A stacked q|k|v or gate|up
whose matrices are not whole 128-row blocks (a 64-row K projection) cannot share one block grid: it stays
dequantised, as on GPUs other than Hopper.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
BLOCK = 128
MIN_SCALE = 1e-12  # an all-zero group of activations must not divide by zero


def block_gemm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch has the block-scaled GEMM for `device`: CUDA sm90 (Hopper), bf16 or fp16 outputs."""
    return (
        device.type == "cuda"
        and hasattr(F, "scaled_mm")
        and dtype in (torch.bfloat16, torch.float16)
        and torch.cuda.get_device_capability(device)[0] == 9
    )


class Fp8BlockLinear(nn.Module):
    """y = x @ (weight * scale)^T with `weight` [out, in] e4m3 and `scale` [out / 128, in / 128] (the checkpoint's
    weight_scale_inv: w = weight * scale)."""

    def __init__(
        self,
        *,
        weight: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = dtype
        k_blocks = self.in_features // BLOCK
        padded = F.pad(scale.float(), (0, -k_blocks % 4)).to(device)
        # NOTE: LoRA sizes its buffers from a module's first floating tensor (parameters, then buffers): without
        # a bias that is this serving-dtype scalar, registered first.
        self.register_buffer("dtype_hint", torch.zeros((), dtype=dtype, device=device))
        self.register_buffer("scale_t", padded.t())  # [K blocks (padded), out / 128], K-major
        self.register_buffer("weight", weight.to(device).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.to(device, dtype), requires_grad=False)

    @staticmethod
    def fits(
        matrix_rows: list[int],
        in_features: int,
        block: tuple[int, int] | None,
        device: torch.device,
        dtype: torch.dtype,
    ) -> bool:
        """Whether a stacked linear of matrices with `matrix_rows` rows each can run here."""
        return (
            block == (BLOCK, BLOCK)
            and block_gemm_runs(device, dtype)
            and in_features % BLOCK == 0
            and all(rows % BLOCK == 0 for rows in matrix_rows)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.in_features)
        tokens = x.shape[0]
        if tokens % 4:
            x = F.pad(x, (0, 0, 0, -tokens % 4))
        groups = x.float().view(x.shape[0], -1, BLOCK)
        sx = (groups.abs().amax(-1) / FP8_MAX).clamp_(min=MIN_SCALE)  # [tokens, K / 128]
        xq = (groups / sx[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8).view(x.shape)
        y = F.scaled_mm(
            mat_a=xq,
            mat_b=self.weight.t(),
            scale_a=sx.t().contiguous().t(),
            scale_recipe_a=F.ScalingType.BlockWise1x128,
            scale_b=self.scale_t,
            scale_recipe_b=F.ScalingType.BlockWise128x128,
            output_dtype=self.dtype,
        )[:tokens]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)
