"""Mistral 3's multi-modal projector (transformers' Mistral3MultiModalProjector): an RMSNorm over the tower's
features, the patch merger (each merge x merge block of an image's patch grid, unfolded channel-major as
F.unfold lays it out, through one bias-free matrix back to the vision width), then linear_1, the activation and
linear_2 into the text model's width."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.layers.norm import RMSNorm
from engine.model.vision.pixtral import ACTIVATIONS


class PatchMerger(nn.Module):
    def __init__(self, width: int, merge: int) -> None:
        super().__init__()
        self.merge = merge
        self.merging_layer = nn.Linear(width * merge**2, width, bias=False)

    def forward(self, features: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """One image's [rows * columns, width] -> [(rows / merge) * (columns / merge), width], row by row."""
        (r, c), d, m = grid, features.shape[-1], self.merge
        blocks = F.unfold(features.view(r, c, d).permute(2, 0, 1)[None], kernel_size=m, stride=m)
        return self.merging_layer(blocks.view(d * m * m, -1).T)


class Mistral3Projector(nn.Module):
    """Per image [patches, vision hidden] and its patch grid -> [merged patches, text hidden]."""

    def __init__(self, *, vision_hidden: int, text_hidden: int, merge: int, act: str, bias: bool, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(vision_hidden, eps)
        self.patch_merger = PatchMerger(vision_hidden, merge)
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.act = ACTIVATIONS[act]
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, features: list[torch.Tensor], grids: list[tuple[int, int]]) -> list[torch.Tensor]:
        merged = [self.patch_merger(self.norm(f), grid) for f, grid in zip(features, grids, strict=True)]
        out = self.linear_2(self.act(self.linear_1(torch.cat(merged))))
        return list(out.split([len(m) for m in merged]))
