"""GPTQ (AutoGPTQ / GPTQModel): qweight [in / 8, out] int32, 8 input rows per word, nibble i = row 8j + i;
qzeros [in / group, out / 8] int32, nibble i = column 8j + i; scales [in / group, out] fp16; g_idx [in].
w = (q - z) * s, where checkpoint_format "gptq" (v1) stores z - 1 and "gptq_v2" stores z."""

from __future__ import annotations

import torch

from engine.errors import UnsupportedModel
from engine.model.quant.base import CheckpointLinear, TensorLayout
from engine.model.quant.int4 import Int4Format, Int4Weights, unpack_nibbles, whole_groups
from engine.model.quant.shards import input_positions


class GptqFormat(Int4Format):
    name = "gptq"
    layouts = (
        TensorLayout(suffix="qweight", dtype=torch.int32, dim=1),
        TensorLayout(suffix="qzeros", dtype=torch.int32, dim=1, rows_per_entry=8),
        TensorLayout(suffix="scales", dtype=torch.float32, dim=1),
        TensorLayout(suffix="g_idx", dtype=torch.int32, dim=None, required=False),
    )

    tensor_parallel = True

    def __init__(self, group: int | None, zeros_minus_one: bool) -> None:
        self.group, self.zeros_minus_one = group, zeros_minus_one

    def input_axis(self, layout: TensorLayout) -> tuple[int, int] | None:
        if layout.suffix in ("qweight", "g_idx"):
            return 0, 8 if layout.suffix == "qweight" else 1
        return None if self.group is None else (0, self.group)  # group_size -1: one scale per output row

    def expected_shapes(self, rows: int, in_features: int) -> dict[str, tuple[int, ...]]:
        groups = whole_groups(in_features, self.group or in_features)
        if in_features % 8:
            raise UnsupportedModel(f"has {in_features} inputs; gptq packs them 8 to a word", param="model")
        return {"qweight": (in_features // 8, rows), "scales": (groups, rows), "g_idx": (in_features,)}

    def unpack(self, linear: CheckpointLinear) -> Int4Weights:
        codes = unpack_nibbles(linear.qweight, dim=0).t()
        group = self.group or codes.shape[1]  # group_size -1: one group per row
        g_idx = linear.tensor("g_idx")
        if g_idx is not None:  # a row-parallel rank's: its inputs' groups, counted from the checkpoint's first
            inputs = input_positions(next(iter(linear.matrix_sources.values()), None), codes.shape[1])
            expected = (inputs // self.group if self.group else inputs * 0).to(g_idx.device)
            if not torch.equal(g_idx.long(), expected.expand_as(g_idx)):
                raise UnsupportedModel(
                    "gptq: g_idx is not in group order (desc_act true is not supported)", param="model"
                )
        zeros = unpack_nibbles(linear.qzeros, dim=1)
        if self.zeros_minus_one:
            zeros = (zeros + 1) & 15
        return Int4Weights(codes, zeros.t().float(), linear.scales.t().float(), group)


def read_gptq(qc: dict) -> GptqFormat:
    """GptqFormat for a quantization_config; one line for what it cannot read."""
    if qc.get("bits", 4) != 4:
        raise UnsupportedModel(f"gptq with {qc.get('bits')} bits is not supported (4)", param="model")
    if qc.get("desc_act"):
        raise UnsupportedModel("gptq with desc_act true is not supported (desc_act false)", param="model")
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise UnsupportedModel(f"gptq checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)", param="model")
    group = qc.get("group_size", 128)
    if not isinstance(group, int) or (group <= 0 and group != -1):
        raise UnsupportedModel(f"gptq group_size {group!r} is not supported", param="model")
    return GptqFormat(None if group == -1 else group, zeros_minus_one=fmt == "gptq")
