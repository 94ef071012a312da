"""Qwen2.5-VL's window attention order (transformers' get_vision_window_index): each image's merge units (the
merge x merge blocks of patches that become one token) cut into squares of `side` x `side` units, the last row and
column of squares cut short where the grid does not divide. The tower lists its patches window by window (units
row by row within a window) so that each window is one run of patches for image_attention, and puts the merged
tokens back in the image's order at the end."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WindowOrder:
    """units: the merge units' indices (over the whole batch) in window order; lengths: each window's patches."""

    units: torch.Tensor
    lengths: list[int]

    def patches(self, unit_size: int) -> torch.Tensor:
        """The patches' indices in window order (each unit's unit_size patches stay together, in their order)."""
        return (self.units[:, None] * unit_size + torch.arange(unit_size)).flatten()


def window_order(grids: list[tuple[int, int, int]], *, merge: int, side: int) -> WindowOrder:
    """The window order of a batch of images of grids (1, h, w) in patches; `side`: a window's side in units
    (window_size // merge // patch_size)."""
    units, lengths, offset = [], [], 0
    for _, h, w in grids:
        rows, cols = h // merge, w // merge
        index = torch.arange(rows * cols).view(rows, cols) + offset
        for top in range(0, rows, side):
            for left in range(0, cols, side):
                window = index[top : top + side, left : left + side].flatten()
                units.append(window)
                lengths.append(window.numel() * merge * merge)
        offset += rows * cols
    return WindowOrder(torch.cat(units), lengths)
