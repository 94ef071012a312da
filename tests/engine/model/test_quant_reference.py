"""Each quantized format's float32 dequantisation: hand-checked words for AWQ and GPTQ's packing orders, and the
format's own library (compressed-tensors, transformers' FP8 dequantiser) for the rest."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.errors import UnsupportedModel
from engine.model.quant.awq import AwqFormat, unpack_awq_columns
from engine.model.quant.base import CheckpointLinear
from engine.model.quant.compressed_tensors import PackedInt4Format
from engine.model.quant.fp8 import Fp8Format
from engine.model.quant.gptq import GptqFormat
from engine.model.quant.registry import quant_format
from tests.engine.model.quant_writers import (
    checkpoint_linear,
    compressed_fp8_tensors,
    compressed_int4_tensors,
    fp8_block_tensors,
    int4_codes,
)

WORD = 0x76543210  # nibble i holds the value i


def test_awq_columns_sit_in_nibbles_0_2_4_6_1_3_5_7() -> None:
    # AutoAWQ packs column ORDER[i] into nibble i, ORDER = 0 2 4 6 1 3 5 7: nibble value i lands in column ORDER[i].
    assert unpack_awq_columns(torch.tensor([[WORD]], dtype=torch.int32)).tolist() == [[0, 4, 1, 5, 2, 6, 3, 7]]


def test_awq_hand_checked_weight() -> None:
    # in 8, out 8, one group: codes per column as above, zeros all 2 (0x22222222), scales 0.5 per column.
    tensors = {
        "qweight": torch.full((8, 1), WORD, dtype=torch.int32),
        "qzeros": torch.tensor([[0x22222222]], dtype=torch.int32),
        "scales": torch.full((1, 8), 0.5),
    }
    w = AwqFormat(group=8).dequantize(checkpoint_linear(AwqFormat(8), tensors, 8, 8))
    expected = (torch.tensor([0, 4, 1, 5, 2, 6, 3, 7.0]) - 2) * 0.5
    assert torch.equal(w, expected[:, None].expand(8, 8))


def test_gptq_rows_and_v1_zeros_hand_checked() -> None:
    # qweight packs 8 input rows per word (row i in nibble i); v1 qzeros store z - 1: 7 -> 8, 15 -> 0, 0 -> 1.
    fmt = GptqFormat(group=8, zeros_minus_one=True)
    tensors = {
        "qweight": torch.full((1, 8), WORD, dtype=torch.int32),
        "qzeros": torch.tensor([[0xF7777F07 - 2**32]], dtype=torch.int32),
        "scales": torch.full((1, 8), 0.25),
        "g_idx": torch.zeros(8, dtype=torch.int32),
    }
    w = fmt.dequantize(checkpoint_linear(fmt, tensors, 8, 8))
    zeros = torch.tensor([8.0, 1, 0, 8, 8, 8, 8, 0])  # nibble 7 = 15: the sign bit
    assert torch.equal(w, (torch.arange(8.0)[None, :] - zeros[:, None]) * 0.25)


def test_gptq_refuses_act_order_g_idx() -> None:
    fmt = GptqFormat(group=4, zeros_minus_one=True)
    tensors = {
        "qweight": torch.full((1, 8), WORD, dtype=torch.int32),
        "qzeros": torch.zeros(2, 1, dtype=torch.int32),
        "scales": torch.ones(2, 8),
        "g_idx": torch.tensor([1, 0, 1, 0, 1, 0, 1, 0], dtype=torch.int32),
    }
    with pytest.raises(UnsupportedModel, match="desc_act true is not supported"):
        fmt.dequantize(checkpoint_linear(fmt, tensors, 8, 8))


@pytest.mark.parametrize(("symmetric", "group"), [(True, 32), (False, 32), (False, 128)])
def test_compressed_tensors_int4_equals_the_library(symmetric: bool, group: int) -> None:
    torch.manual_seed(0)
    tensors, reference = compressed_int4_tensors(torch.randn(48, 256), group, symmetric)
    fmt = PackedInt4Format(group, symmetric)
    w = fmt.dequantize(checkpoint_linear(fmt, tensors, 256, 48))
    torch.testing.assert_close(w, reference, rtol=0, atol=0)


def test_compressed_tensors_fp8_per_channel_equals_the_library() -> None:
    torch.manual_seed(0)
    tensors, reference = compressed_fp8_tensors(torch.randn(48, 64))
    fmt = Fp8Format("compressed-tensors fp8", "weight_scale", "channel")
    torch.testing.assert_close(fmt.dequantize(checkpoint_linear(fmt, tensors, 64, 48)), reference, rtol=0, atol=0)


def test_fp8_per_tensor_scales_each_stacked_matrix_by_its_own() -> None:
    weight = torch.randn(16, 32).to(torch.float8_e4m3fn)
    fmt = Fp8Format("compressed-tensors fp8", "weight_scale", "tensor")
    shapes = {"weight": (8, 32), "weight_scale": (1,)}
    linear = CheckpointLinear(fmt=fmt, shards={"k_proj": 8, "v_proj": 8}, in_features=32, bias=False, shapes=shapes)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    linear.weight_scale = nn.Parameter(torch.tensor([[0.5], [3.0]]), requires_grad=False)
    expected = weight.float() * torch.tensor([0.5] * 8 + [3.0] * 8)[:, None]
    assert torch.equal(fmt.dequantize(linear), expected)


def test_fp8_blocks_equal_transformers_dequantiser() -> None:
    torch.manual_seed(0)
    tensors, reference = fp8_block_tensors(torch.randn(256, 384))
    fmt = Fp8Format("fp8", "weight_scale_inv", "block", (128, 128))
    torch.testing.assert_close(fmt.dequantize(checkpoint_linear(fmt, tensors, 384, 256)), reference, rtol=0, atol=0)


def test_int4_codes_round_trip_through_awq_packing() -> None:
    from tests.engine.model.quant_writers import awq_tensors

    torch.manual_seed(0)
    tensors, reference = awq_tensors(torch.randn(64, 256))
    assert torch.equal(AwqFormat(128).dequantize(checkpoint_linear(AwqFormat(128), tensors, 256, 64)), reference)
    q, z, s = int4_codes(torch.randn(16, 128), 128, symmetric=True)
    assert z.eq(8).all() and q.min() >= 0 and q.max() <= 15


@pytest.mark.parametrize(
    ("qc", "message"),
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantization 'bitsandbytes' is not supported"),
        ({"quant_method": "exl2"}, "quantization 'exl2' is not supported"),
        ({"quant_method": "hqq"}, "quantization 'hqq' is not supported"),
        ({"quant_method": "gptq", "bits": 4, "desc_act": True}, "desc_act true is not supported"),
        ({"quant_method": "gptq", "bits": 8}, "gptq with 8 bits is not supported"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "awq version 'gemv' is not supported"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "marlin-24",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}},
            },
            "compressed-tensors format 'marlin-24'",
        ),
    ],
)
def test_other_formats_fail_with_one_line(qc: dict, message: str) -> None:
    with pytest.raises(UnsupportedModel, match=message) as info:
        quant_format({"quantization_config": qc})
    assert "\n" not in str(info.value)
    if "is not supported:" in str(info.value):
        assert "awq" in str(info.value) and "gptq" in str(info.value) and "fp8" in str(info.value)
