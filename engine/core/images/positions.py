"""A step's rotary positions. A token's position is its index in the sequence, except where a prompt holds images
with 3-D positions (Qwen-VL's mrope, transformers' get_rope_index): an image's tokens take (t, h, w) = (s, s + row,
s + column) where s is the position the next text token would have had, and the text after the image continues
from its largest position + 1, so every later token (the generated ones too, as vLLM's mrope_position_delta does)
is shifted by the same amount: 1-D positions, shifted. Only rows of image tokens need three positions; a step with
none passes [T], a step with some [3, T].
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.core.images.intake import ImageSpan


class StepPositions:
    """Collects each scheduled chunk's positions, in row order; tensor() once per step."""

    def __init__(self) -> None:
        self.flat: list[int] = []  # every row's text (temporal) position
        self.grid: list[tuple[int, int, int]] = []  # (row, row offset, column offset) of the image tokens

    def add(self, spans: list[ImageSpan], start: int, end: int) -> None:
        """The positions of sequence indices [start, end) of a sequence whose prompt holds `spans`."""
        shift, p = 0, start
        for span in spans:
            if span.rope_grid is None:
                continue
            if span.start >= end:
                break
            rows, cols = span.rope_grid
            if span.end > p:
                text_end = min(span.start, end)
                if text_end > p:
                    self.flat += range(p + shift, text_end + shift)
                    p = text_end
                base = span.start + shift
                for i in range(p - span.start, min(span.end, end) - span.start):
                    self.grid.append((len(self.flat), i // cols, i % cols))
                    self.flat.append(base)
                p = max(p, min(span.end, end))
            shift += max(rows, cols) - (span.end - span.start)
        self.flat += range(p + shift, end + shift)

    def tensor(self, device: torch.device) -> torch.Tensor:
        pos = torch.tensor(self.flat, dtype=torch.long)
        if self.grid:
            rows, dh, dw = (torch.tensor(c, dtype=torch.long) for c in zip(*self.grid, strict=True))
            pos = pos.expand(3, -1).clone()
            pos[1, rows] += dh
            pos[2, rows] += dw
        return pos.to(device, non_blocking=True)
