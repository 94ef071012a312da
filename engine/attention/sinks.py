"""Attention sinks (gpt-oss) for SDPA: a learned per-head logit in the softmax's denominator with no value.

SDPA has no sink argument, so the sink becomes one more key that every query sees: the head dimension grows
by one, real keys get 0 there and the sink key 1, each query head gets its sink logit * sqrt(head_dim) there
(under the original 1/sqrt(head_dim) scale that scores exactly the sink logit), and the sink key's value is
zero. The output is then softmax([scores, sink]) @ [V, 0], which is what gpt-oss computes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def sdpa_with_sink(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    sinks: torch.Tensor,
    enable_gqa: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """SDPA of q [..., Hq', Lq, D] over k, v [..., Hk, L, D] plus one sink key; a (non-contiguous) [..., Lq, D].

    sinks: the sink logits shaped to broadcast over q's [..., Hq', Lq] (e.g. [Hq', 1]); mask: bool
    [..., Lq, L] (True: seen) or None for no mask (every key seen). scale: None for 1/sqrt(D).
    """
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    column = (sinks.to(q.dtype) / scale)[..., None].expand(*q.shape[:-1], 1)
    q = torch.cat([q, column], dim=-1)
    k = F.pad(k, (0, 1, 0, 1))  # a zero last dimension for the real keys, and the sink key's row
    k[..., -1, -1] = 1.0
    # The sink key's value is zero. NOTE: V is padded to D + 1 too: with value and key sizes unequal CPU SDPA
    # leaves its flash kernel for the math path (measured 13x slower at decode, 3.5x at prefill).
    v = F.pad(v, (0, 1, 0, 1))
    if mask is not None:
        mask = torch.cat([mask, mask.new_ones(*mask.shape[:-1], 1)], dim=-1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return out[..., :d]
