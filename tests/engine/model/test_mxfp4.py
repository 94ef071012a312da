"""MXFP4 dequantisation: the same values as transformers' convert_moe_packed_tensors on random blocks."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from engine.model.quant import mxfp4
from engine.model.quant.mxfp4 import dequantize_mxfp4


def random_mxfp4(
    experts: int, rows: int, cols: int, seed: int, lo: int = 112, hi: int = 136
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks over every FP4 code and e8m0 scales in [lo, hi), shaped as the hub stores gpt-oss experts."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(lo, hi, (experts, rows, cols // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_transformers_bit_for_bit(dtype: torch.dtype) -> None:
    blocks, scales = random_mxfp4(4, 48, 96, seed=0)
    ours = dequantize_mxfp4(blocks, scales, dtype)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    assert ours.shape == (4, 48, 96) and ours.dtype == dtype
    assert torch.equal(ours.transpose(1, 2), theirs)
    # -0.0 (code 8) equals 0.0 under torch.equal: the sign bits must match too.
    assert torch.equal(torch.signbit(ours.transpose(1, 2)), torch.signbit(theirs))


def test_extreme_scales_and_chunk_edges_match(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every e8m0 scale (2**-127 .. 2**128: subnormal, overflow) over rows that straddle several chunks.
    monkeypatch.setattr(mxfp4, "ROWS_PER_CHUNK", 7)
    blocks, scales = random_mxfp4(2, 25, 64, seed=1, lo=0, hi=256)
    for dtype in (torch.float32, torch.bfloat16):
        ours = dequantize_mxfp4(blocks, scales, dtype).transpose(1, 2)
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        assert torch.equal(ours.isnan(), theirs.isnan())
        assert torch.equal(ours.nan_to_num(), theirs.nan_to_num())


def test_known_values() -> None:
    # Byte 0x91: low nibble 1 (+0.5), high nibble 9 (-0.5); scale 129 = 2**2.
    blocks = torch.full((1, 1, 16), 0x91, dtype=torch.uint8)
    scales = torch.tensor([[129]], dtype=torch.uint8)
    row = dequantize_mxfp4(blocks, scales, torch.float32)[0]
    assert row.tolist() == [2.0, -2.0] * 16


def test_mismatched_shapes_and_dtypes_are_refused() -> None:
    blocks, scales = random_mxfp4(1, 4, 64, seed=2)
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales[..., :1])
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(blocks.to(torch.int32), scales)
