"""Full attention within each image of a batch whose patches lie one image after another, through fused SDPA.

NOTE: torch's fused CPU kernel (flash) takes 4-D inputs only; 3-D ones fall back to the unfused math (a score
matrix per head, a softmax with NaN guards), 3-4x slower. Images of the same patch count, the usual case for a
batch, run as one batched call on views of the inputs; the others one call per patch count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def image_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], scale: float | None = None
) -> torch.Tensor:
    """q [T, heads, d], k and v [T, kv_heads, d] (T = sum(lengths), any strides whose first dimension splits by
    image) -> [T, heads, d], each patch attending to every patch of its own image and none of another's."""
    gqa = q.shape[1] != k.shape[1]
    if len(set(lengths)) == 1:
        return _attend(q, k, v, len(lengths), scale, gqa)
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0).tolist()
    for n in dict.fromkeys(lengths):
        rows = torch.cat([torch.arange(s, s + n) for s, m in zip(starts, lengths, strict=True) if m == n])
        rows = rows.to(q.device)
        out[rows] = _attend(q[rows], k[rows], v[rows], rows.numel() // n, scale, gqa)
    return out


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, images: int, scale: float | None, gqa: bool
) -> torch.Tensor:
    """q, k, v holding `images` images of the same patch count -> [T, heads, d]."""
    q, k, v = (t.view(images, -1, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))  # [images, heads, n, d]
    out = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2).flatten(0, 1)
