"""AWQ (AutoAWQ's GEMM layout): qweight [in, out / 8] and qzeros [in / group, out / 8] int32, 8 output columns
per word in the order 0 2 4 6 1 3 5 7; scales [in / group, out] fp16; w = (q - z) * s."""

from __future__ import annotations

import torch

from engine.errors import UnsupportedModel
from engine.model.quant.base import CheckpointLinear, TensorLayout
from engine.model.quant.int4 import Int4Format, Int4Weights, unpack_nibbles, whole_groups

# Nibble i of a word holds column AWQ_ORDER[i] of its 8; column m sits in nibble AWQ_REVERSE_ORDER[m].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def unpack_awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """[rows, out / 8] AWQ words -> [rows, out] values 0..15 in column order."""
    nibbles = unpack_nibbles(packed, dim=1).view(packed.shape[0], -1, 8)
    return nibbles[..., list(AWQ_REVERSE_ORDER)].reshape(packed.shape[0], -1)


class AwqFormat(Int4Format):
    name = "awq"
    layouts = (
        TensorLayout(suffix="qweight", dtype=torch.int32, dim=1, rows_per_entry=8),
        TensorLayout(suffix="qzeros", dtype=torch.int32, dim=1, rows_per_entry=8),
        TensorLayout(suffix="scales", dtype=torch.float32, dim=1),
    )

    tensor_parallel = True

    def __init__(self, group: int) -> None:
        self.group = group

    def input_axis(self, layout: TensorLayout) -> tuple[int, int] | None:
        return 0, 1 if layout.suffix == "qweight" else self.group

    def expected_shapes(self, rows: int, in_features: int) -> dict[str, tuple[int, ...]]:
        if rows % 8:
            raise UnsupportedModel(f"has {rows} output rows; awq packs them 8 to a word", param="model")
        groups = whole_groups(in_features, self.group)
        return {"qweight": (in_features, rows // 8), "qzeros": (groups, rows // 8), "scales": (groups, rows)}

    def unpack(self, linear: CheckpointLinear) -> Int4Weights:
        codes = unpack_awq_columns(linear.qweight).t()
        zeros = unpack_awq_columns(linear.qzeros).t().float()
        return Int4Weights(codes, zeros, linear.scales.t().float(), self.group)


def read_awq(qc: dict) -> AwqFormat:
    """AwqFormat for a quantization_config; one line for what it cannot read."""
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise UnsupportedModel(f"awq version {version!r} is not supported (gemm)", param="model")
    if qc.get("bits", qc.get("w_bit", 4)) != 4:
        raise UnsupportedModel(f"awq with {qc.get('bits', qc.get('w_bit'))} bits is not supported (4)", param="model")
    if not qc.get("zero_point", True):
        raise UnsupportedModel("awq without zero points is not supported", param="model")
    group = qc.get("group_size", qc.get("q_group_size", 128))
    if not isinstance(group, int) or group <= 0:
        raise UnsupportedModel(f"awq group_size {group!r} is not supported (a positive group)", param="model")
    return AwqFormat(group)
