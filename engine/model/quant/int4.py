"""What AWQ, GPTQ and compressed-tensors W4A16 have in common: per group of inputs, w = (code - zero) * scale,
with 4-bit codes. Each format unpacks its checkpoint into Int4Weights; this module dequantises those and repacks
them for torch's int4 kernel.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from engine.errors import UnsupportedModel
from engine.model.layers.linear import INT4_KERNEL_GROUPS, Int4Linear
from engine.model.quant.base import CheckpointLinear, QuantFormat, dense_linear

log = logging.getLogger(__name__)

NIBBLE_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


@dataclass
class Int4Weights:
    """codes [out, in] (0..15), zeros and scales [out, in / group] (float32; a zero in code units)."""

    codes: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    group: int

    def dequantize(self) -> torch.Tensor:
        zeros = self.zeros.repeat_interleave(self.group, dim=1)
        scales = self.scales.repeat_interleave(self.group, dim=1)
        return (self.codes.float() - zeros) * scales


def whole_groups(in_features: int, group: int) -> int:
    """How many groups of `group` inputs a matrix has; UnsupportedModel when its inputs are not whole groups (the
    formats' writers and torch's int4 kernels take none other)."""
    if in_features % group:
        raise UnsupportedModel(f"has {in_features} inputs, not whole groups of {group}", param="model")
    return in_features // group


def unpack_nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words holding 8 nibbles each (nibble i at bits 4i..4i+3) -> their values 0..15, the 8 of each word
    side by side along `dim` (so [a, b] packed along dim 1 becomes [a, 8 b])."""
    nibbles = (packed.unsqueeze(-1) >> NIBBLE_SHIFTS.to(packed.device)) & 15  # [..., 8]: nibble i last
    if dim == 1:
        return nibbles.reshape(packed.shape[0], -1)
    return nibbles.permute(0, 2, 1).reshape(-1, packed.shape[1])


class TinygemmInt4Linear(nn.Module):
    """Weight-only 4-bit Linear on CUDA through torch's tinygemm kernel (bfloat16 activations): the same
    (code - 8) * scale + zero per group as the CPU kernel, with codes packed two to a byte, high nibble first."""

    INNER_K_TILES = 8

    def __init__(self, weights: Int4Weights, bias: torch.Tensor | None, device: torch.device) -> None:
        super().__init__()
        codes = weights.codes.to(device=device, dtype=torch.int32)
        self.group, self.out_features, self.in_features = weights.group, *codes.shape
        pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack(pairs, self.INNER_K_TILES))
        zero = (8 - weights.zeros) * weights.scales
        sz = torch.stack([weights.scales, zero], -1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", sz.to(device=device, dtype=torch.bfloat16))
        self.bias = None if bias is None else nn.Parameter(bias.to(device, torch.bfloat16), requires_grad=False)

    @classmethod
    def fits(cls, weights: Int4Weights, device: torch.device, dtype: torch.dtype) -> bool:
        out, k = weights.codes.shape
        return (
            device.type == "cuda"
            and dtype == torch.bfloat16
            and weights.group in INT4_KERNEL_GROUPS
            and out % 8 == 0
            and k % (cls.INNER_K_TILES * 16) == 0
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm(x, self.packed, self.group, self.scales_and_zeros)
        return y if self.bias is None else y.add_(self.bias)


class Int4Format(QuantFormat):
    """A 4-bit format: its unpack() gives Int4Weights; it serves them through torch's CPU int4 kernel."""

    def unpack(self, linear: CheckpointLinear) -> Int4Weights:
        raise NotImplementedError

    def dequantize(self, linear: CheckpointLinear) -> torch.Tensor:
        return self.unpack(linear).dequantize()

    def serving_module(self, linear: CheckpointLinear, dtype: torch.dtype, device: torch.device) -> nn.Module:
        weights = self.unpack(linear)
        if TinygemmInt4Linear.fits(weights, device, dtype):
            module = TinygemmInt4Linear(weights, None if linear.bias is None else linear.bias.detach(), device)
            module.shard_offsets = linear.shard_offsets
            return module
        why = _kernel_refusal(weights, device)
        if why is not None:
            # NOTE: exact, but the weight takes the serving dtype's bytes; each reason said once per model at load
            # (a hybrid's small in_proj_ba rows go this way while its other layers keep the kernel).
            said = self.__dict__.setdefault("_said_dense", set())
            if why not in said:
                log.warning("%s: %s layers are dequantised to %s: %s", self.name, device.type, dtype, why)
                said.add(why)
            return dense_linear(linear, weights.dequantize(), dtype)
        # The kernel computes (code - 8) * scale + zero: (code - z) * s is that with zero = (8 - z) * s.
        bias = None if linear.bias is None else linear.bias.detach()
        module = Int4Linear(
            codes=weights.codes,
            scale=weights.scales,
            zero=(8 - weights.zeros) * weights.scales,
            group=weights.group,
            bias=bias,
            dtype=dtype,
        )
        module.shard_offsets = linear.shard_offsets
        return module


def _kernel_refusal(weights: Int4Weights, device: torch.device) -> str | None:
    """Why torch's CPU int4 kernel cannot serve these weights on `device` (None: it can)."""
    out, _ = weights.codes.shape
    if device.type != "cpu":
        return "torch's int4 kernels run on CPU, or on CUDA in bfloat16 (whole 128-input tiles, rows of 8)"
    if weights.group not in INT4_KERNEL_GROUPS:
        return f"group {weights.group} (the CPU int4 kernel takes groups of {INT4_KERNEL_GROUPS})"
    if out % 16:
        return f"{out}-row layers (the CPU int4 kernel takes multiples of 16 rows)"
    return None
