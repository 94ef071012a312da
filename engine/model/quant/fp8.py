"""FP8 (e4m3) weights: compressed-tensors float-quantized (per-tensor, per-channel or block scales), the hub's
block-wise `fp8` (weight_scale_inv per 128 x 128 block, as Qwen3-FP8 and DeepSeek ship) and `fbgemm_fp8`
(per-channel). w = weight * scale.

On CUDA GPUs with FP8 tensor cores (sm89+) per-tensor and per-channel weights stay in FP8 and run through
torch._scaled_mm (fp8_linear.py), block-scaled ones on Hopper through the block-scaled GEMM (fp8_block_linear.py);
elsewhere the weight is dequantised to the serving dtype at load. NOTE: the checkpoint's static activation scales
(input_scale) are read for their shape only: the FP8 matmuls quantise activations with a dynamic scale.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from engine.errors import UnsupportedModel
from engine.model.quant.base import CheckpointLinear, QuantFormat, TensorLayout, dense_linear
from engine.model.quant.fp8_block_linear import Fp8BlockLinear
from engine.model.quant.fp8_linear import Fp8Linear

log = logging.getLogger(__name__)

STRATEGIES = ("tensor", "channel", "block")


class Fp8Format(QuantFormat):
    """`scale` is the checkpoint's name for the weight scale; `block` its [rows, columns] for block scales."""

    tensor_parallel = True

    def __init__(self, name: str, scale: str, strategy: str, block: tuple[int, int] | None = None) -> None:
        self.name, self.scale, self.strategy, self.block = name, scale, strategy, block
        scale_layout = {
            "tensor": TensorLayout(suffix=scale, dtype=torch.float32, dim=None),
            "channel": TensorLayout(suffix=scale, dtype=torch.float32, dim=0),
            "block": TensorLayout(
                suffix=scale, dtype=torch.float32, dim=0, rows_per_entry=block[0] if block else 1, ragged=True
            ),
        }[strategy]
        self.layouts = (
            TensorLayout(suffix="weight", dtype=torch.float8_e4m3fn),
            scale_layout,
            TensorLayout(suffix="input_scale", dtype=torch.float32, dim=None, required=False),
        )

    @property
    def marker(self) -> str:
        return self.scale  # a float linear the checkpoint left alone has a weight too

    def input_axis(self, layout: TensorLayout) -> tuple[int, int] | None:
        if layout.suffix == "weight":
            return 1, 1
        return (1, self.block[1]) if layout.suffix == self.scale and self.strategy == "block" else None

    def expected_shapes(self, rows: int, in_features: int) -> dict[str, tuple[int, ...]]:
        shapes = {"weight": (rows, in_features)}
        if self.strategy == "block":
            shapes[self.scale] = (math.ceil(rows / self.block[0]), math.ceil(in_features / self.block[1]))
        return shapes

    def row_scale(self, linear: CheckpointLinear) -> torch.Tensor:
        """The weight scale of each output row [out, 1] (per-tensor and per-channel strategies)."""
        scale = getattr(linear, self.scale)
        return linear.rows_of_each(scale) if self.strategy == "tensor" else scale.reshape(-1, 1)

    def serving_module(self, linear: CheckpointLinear, dtype: torch.dtype, device: torch.device) -> nn.Module:
        """The FP8 weight itself on a GPU with FP8 tensor cores (block scales: on Hopper); else dequantised."""
        bias = None if linear.bias is None else linear.bias.detach()
        if self.strategy == "block" and Fp8BlockLinear.fits(
            [size for _, size in linear.shard_offsets.values()], linear.in_features, self.block, device, dtype
        ):
            module = Fp8BlockLinear(
                weight=linear.weight.detach(),
                scale=getattr(linear, self.scale).detach(),
                bias=bias,
                dtype=dtype,
                device=device,
            )
            module.shard_offsets = linear.shard_offsets
            return module
        if self.strategy == "block" or not Fp8Linear.fits(tuple(linear.weight.shape), device, dtype):
            if device.type == "cuda" and not getattr(self, "_said_dense", False):
                log.warning(
                    "%s: weights dequantised to %s (%s)",
                    self.name,
                    dtype,
                    "block scales off Hopper, or matrices not in whole 128-row blocks"
                    if self.strategy == "block"
                    else "no FP8 matmul on this GPU",
                )
                self._said_dense = True
            return dense_linear(linear, self.dequantize(linear), dtype)
        module = Fp8Linear(
            weight=linear.weight.detach(), row_scale=self.row_scale(linear), bias=bias, dtype=dtype, device=device
        )
        module.shard_offsets = linear.shard_offsets
        return module

    def dequantize(self, linear: CheckpointLinear) -> torch.Tensor:
        weight = linear.weight.float()
        if self.strategy in ("tensor", "channel"):
            return weight * self.row_scale(linear)
        layout = self.layouts[1]
        rows = linear.rows_per_matrix(getattr(linear, self.scale), layout)  # [out, column blocks]
        return weight * rows.repeat_interleave(self.block[1], dim=1)[:, : weight.shape[1]]


def read_fp8_block(qc: dict) -> Fp8Format:
    """The hub's `fp8` (transformers' finegrained FP8): weight_scale_inv per block, or per tensor without one."""
    if qc.get("fmt", "e4m3") != "e4m3":
        raise UnsupportedModel(f"fp8 fmt {qc.get('fmt')!r} is not supported (e4m3)", param="model")
    block = qc.get("weight_block_size")
    if block is None:
        return Fp8Format("fp8", "weight_scale_inv", "tensor")
    return Fp8Format("fp8", "weight_scale_inv", "block", (int(block[0]), int(block[1])))


def read_fbgemm_fp8(qc: dict) -> Fp8Format:
    return Fp8Format("fbgemm_fp8", "weight_scale", "channel")


def compressed_tensors_fp8(weights: dict) -> Fp8Format:
    """compressed-tensors' float 8-bit weights (float-quantized or naive-quantized)."""
    strategy = weights.get("strategy", "tensor")
    if strategy not in STRATEGIES:
        raise UnsupportedModel(
            f"compressed-tensors fp8 strategy {strategy!r} is not supported ({', '.join(STRATEGIES)})", param="model"
        )
    if not weights.get("symmetric", True):
        raise UnsupportedModel("compressed-tensors fp8 with zero points is not supported (symmetric)", param="model")
    block = weights.get("block_structure")
    return Fp8Format(
        "compressed-tensors fp8",
        "weight_scale",
        strategy,
        (int(block[0]), int(block[1])) if strategy == "block" else None,
    )
