"""The prefill mask of one request as a boolean [q_len, keys] block: causal from the query offset, OR'd with
the bidirectional spans (an image's tokens see each other both ways: transformers' token_type_ids blocks), AND'd
with the sliding window (keys j > i - W). The torch backend attends under it; FlashInfer takes it as a custom mask.
"""

from __future__ import annotations

import torch


def prefill_mask(
    q_len: int,
    kv_len: int,
    first_key: int,
    window: int | None,
    spans: list[tuple[int, int]] | None,
    device: torch.device,
) -> torch.Tensor:
    """Keys first_key..kv_len-1 for the request's last q_len positions; spans: [start, end) positions."""
    cols = torch.arange(first_key, kv_len, device=device)[None, :]
    pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    mask = cols <= pos
    for start, end in spans or ():
        mask |= (pos >= start) & (pos < end) & (cols >= start) & (cols < end)
    if window is not None:
        mask &= cols > pos - window
    return mask
