"""FP8 (e4m3) weights: compressed-tensors float-quantized (per-tensor, per-channel or block scales), the hub's
block-wise `fp8` (weight_scale_inv per 128 x 128 block, as Qwen3-FP8 and DeepSeek ship) and `fbgemm_fp8`
(per-channel). w = weight * scale, dequantised to the serving dtype at load.

NOTE: activation scales (static input_scale, dynamic per-token) describe an FP8 matmul; the dequantised
weight runs in the serving dtype, so they are read for their shape only.
"""

from __future__ import annotations

import torch

from engine.errors import UnsupportedModel
from engine.model.quant.base import CheckpointLinear, QuantFormat, TensorLayout

STRATEGIES = ("tensor", "channel", "block")


class Fp8Format(QuantFormat):
    """`scale` is the checkpoint's name for the weight scale; `block` its [rows, columns] for block scales."""

    def __init__(self, name: str, scale: str, strategy: str, block: tuple[int, int] | None = None) -> None:
        self.name, self.scale, self.strategy, self.block = name, scale, strategy, block
        scale_layout = {
            "tensor": TensorLayout(scale, torch.float32, dim=None),
            "channel": TensorLayout(scale, torch.float32, dim=0),
            "block": TensorLayout(scale, torch.float32, dim=0, rows_per_entry=block[0] if block else 1),
        }[strategy]
        self.layouts = (
            TensorLayout("weight", torch.float8_e4m3fn),
            scale_layout,
            TensorLayout("input_scale", torch.float32, dim=None, required=False),
        )

    @property
    def marker(self) -> str:
        return self.scale  # a float linear the checkpoint left alone has a weight too

    def dequantize(self, linear: CheckpointLinear) -> torch.Tensor:
        weight, scale = linear.weight.float(), getattr(linear, self.scale)
        if self.strategy == "tensor":
            return weight * linear.rows_of_each(scale)
        if self.strategy == "channel":
            return weight * scale.reshape(-1, 1)
        rows, cols = self.block
        out, inp = weight.shape
        full = scale.repeat_interleave(rows, dim=0)[:out].repeat_interleave(cols, dim=1)[:, :inp]
        return weight * full


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
        raise UnsupportedModel(f"compressed-tensors fp8 strategy {strategy!r} is not supported "
                               f"({', '.join(STRATEGIES)})", param="model")
    if not weights.get("symmetric", True):
        raise UnsupportedModel("compressed-tensors fp8 with zero points is not supported (symmetric)", param="model")
    block = weights.get("block_structure")
    return Fp8Format("compressed-tensors fp8", "weight_scale", strategy,
                     (int(block[0]), int(block[1])) if strategy == "block" else None)
