"""MXFP4 (OCP microscaling FP4) weights as gpt-oss checkpoints store them, dequantised exactly.

A `*_blocks` tensor [..., rows, groups, 16] uint8 packs 32 FP4 (e2m1) codes per group, two per byte, the
low nibble first; `*_scales` [..., rows, groups] uint8 holds one e8m0 scale per group (2 ** (s - 127)).
Every value is an FP4 value times a power of two, so it is exact in float32; in bfloat16 too, unless it
leaves bfloat16's exponent range (as it would in transformers, which computes it the same way).
"""

from __future__ import annotations

import torch

GROUP = 32  # values per e8m0 scale
E8M0_BIAS = 127
# The 16 e2m1 codes: sign bit, two exponent bits, one mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Rows dequantised at a time: bounds the int index tensors (8 bytes per value) a whole 120b expert stack needs.
ROWS_PER_CHUNK = 1 << 16


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[..., rows, groups, 16] blocks and [..., rows, groups] scales -> [..., rows, groups * 32] in `dtype`.

    The result keeps the checkpoint's [..., out_features, in_features] order (an nn.Linear weight per expert);
    transformers' convert_moe_packed_tensors returns the same values transposed to [..., in, out].
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != GROUP // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
            f"(blocks are [..., groups, {GROUP // 2}], scales [..., groups])"
        )
    *prefix, groups, width = blocks.shape
    flat_blocks = blocks.reshape(-1, width)
    flat_exps = scales.reshape(-1, 1).to(torch.int32) - E8M0_BIAS
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    out = torch.empty(flat_blocks.shape[0], GROUP, dtype=dtype, device=blocks.device)
    for lo in range(0, flat_blocks.shape[0], ROWS_PER_CHUNK):
        part, sub = flat_blocks[lo : lo + ROWS_PER_CHUNK], out[lo : lo + ROWS_PER_CHUNK]
        sub[:, 0::2] = lut[(part & 0x0F).long()]
        sub[:, 1::2] = lut[(part >> 4).long()]
        # NOTE: ldexp in `dtype` (not a float32 multiply then a cast) rounds as transformers does at the edges.
        torch.ldexp(sub, flat_exps[lo : lo + ROWS_PER_CHUNK], out=sub)
    return out.view(*prefix, groups * GROUP)
