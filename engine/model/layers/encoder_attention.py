"""Bidirectional attention for encoders, on every device through torch SDPA: a step's rows are whole prompts (the
scheduler runs an encoder's prompt in one chunk), so each sequence's rows attend to one another both ways and need
no pages; a local layer sees only the rows within `window` positions on either side (ModernBERT)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attend_within_sequences(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int], window: int | None = None
) -> torch.Tensor:
    """q, k, v [heads, T, head_dim]; rows bounds[i]:bounds[i+1] are one sequence. Returns [T, heads * head_dim].
    window: a row attends to the rows at most this many positions away (None: the whole sequence)."""
    out = torch.empty_like(q)
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        mask = None
        if window is not None and end - start > window + 1:  # a shorter sequence lies inside every row's window
            position = torch.arange(end - start, device=q.device)
            mask = (position[:, None] - position[None, :]).abs() <= window
        out[:, start:end] = F.scaled_dot_product_attention(
            q[:, start:end], k[:, start:end], v[:, start:end], attn_mask=mask
        )
    return out.transpose(0, 1).reshape(q.shape[1], -1)
