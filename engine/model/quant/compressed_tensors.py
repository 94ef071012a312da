"""compressed-tensors (llm-compressor's format): pack-quantized 4-bit integer weights (W4A16) and float 8-bit
weights (fp8.py). Pack-quantized: weight_packed [out, in / 8] int32, nibble i = input 8j + i, stored as the
signed code + 8; weight_scale [out, in / group]; weight_zero_point [out / 8, in / group] (asymmetric only,
packed along the output rows, also + 8); weight_shape [2]. w = (q - zp) * s in signed codes."""

from __future__ import annotations

import math

import torch

from engine.errors import UnsupportedModel
from engine.model.quant.base import CheckpointLinear, QuantFormat, TensorLayout
from engine.model.quant.fp8 import compressed_tensors_fp8
from engine.model.quant.int4 import Int4Format, Int4Weights, unpack_nibbles, whole_groups

SUPPORTED = "pack-quantized 4-bit int (group or channel) and float-quantized 8-bit float weights"


class PackedInt4Format(Int4Format):
    name = "compressed-tensors pack-quantized"
    tensor_parallel = True

    def __init__(self, group: int | None, symmetric: bool) -> None:
        self.group, self.symmetric = group, symmetric
        self.layouts = (
            TensorLayout(suffix="weight_packed", dtype=torch.int32),
            TensorLayout(suffix="weight_scale", dtype=torch.float32),
            TensorLayout(suffix="weight_shape", dtype=torch.int64, dim=None),
            TensorLayout(suffix="weight_zero_point", dtype=torch.int32, rows_per_entry=8, required=not symmetric),
        )

    def input_axis(self, layout: TensorLayout) -> tuple[int, int] | None:
        if layout.suffix == "weight_packed":
            return 1, 8
        return None if self.group is None or layout.suffix == "weight_shape" else (1, self.group)

    def expected_shapes(self, rows: int, in_features: int) -> dict[str, tuple[int, ...]]:
        groups = whole_groups(in_features, self.group or in_features)
        return {
            "weight_packed": (rows, math.ceil(in_features / 8)),
            "weight_scale": (rows, groups),
            "weight_zero_point": (math.ceil(rows / 8), groups),
        }

    def unpack(self, linear: CheckpointLinear) -> Int4Weights:
        k = linear.in_features
        for (name, (_, size)), shape in zip(linear.shard_offsets.items(), linear.weight_shape.tolist(), strict=True):
            part = linear.matrix_sources.get(name)  # a tensor-parallel rank's: its part of the checkpoint's shape
            if list(part.shape(tuple(shape)) if part else shape) != [size, k]:
                raise UnsupportedModel(
                    f"{self.name}: {name} has weight_shape {shape}, expected {[size, k]}", param="model"
                )
        # Unsigned nibbles are the signed code + 8, and so are packed zero points: (u - 8) - zp = u - (zp + 8).
        codes = unpack_nibbles(linear.weight_packed, dim=1)[:, :k]
        scales = linear.weight_scale.float()
        zp = linear.tensor("weight_zero_point")
        if zp is None:
            zeros = torch.full_like(scales, 8.0)
        else:
            zeros = unpack_nibbles(zp, dim=0)[: codes.shape[0]].float()
        return Int4Weights(codes, zeros, scales, self.group or k)


def read_compressed_tensors(qc: dict) -> QuantFormat | None:
    """The format of a compressed-tensors config whose groups all quantize weights the same way (None: float
    weights, a config that quantizes only the KV cache)."""
    groups = list((qc.get("config_groups") or {}).values())
    if not groups and qc.get("kv_cache_scheme"):
        return None
    schemes = {repr(sorted((g.get("weights") or {}).items())) for g in groups}
    if len(schemes) != 1:
        raise UnsupportedModel(
            f"compressed-tensors with {len(schemes)} weight schemes is not supported (one)", param="model"
        )
    group = groups[0]
    weights = group.get("weights") or {}
    fmt = group.get("format") or qc.get("format")
    kind, bits = weights.get("type"), weights.get("num_bits")
    if fmt in ("float-quantized", "naive-quantized") and kind == "float" and bits == 8:
        return compressed_tensors_fp8(weights)
    if fmt == "pack-quantized" and kind == "int" and bits == 4:
        if (group.get("input_activations") or None) is not None:
            raise UnsupportedModel(
                "compressed-tensors int4 with quantized activations is not supported (W4A16)", param="model"
            )
        if weights.get("actorder") == "group":
            raise UnsupportedModel("compressed-tensors actorder 'group' is not supported", param="model")
        strategy = weights.get("strategy")
        if strategy not in ("group", "channel"):
            raise UnsupportedModel(
                f"compressed-tensors int4 strategy {strategy!r} is not supported (group, channel)", param="model"
            )
        return PackedInt4Format(
            weights.get("group_size") if strategy == "group" else None, bool(weights.get("symmetric", True))
        )
    raise UnsupportedModel(
        f"compressed-tensors format {fmt!r} with {bits}-bit {kind} weights is not supported ({SUPPORTED})",
        param="model",
    )
