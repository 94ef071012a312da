"""Gemma 3's multi-modal projector: the tower's patch grid average-pooled to mm_tokens_per_image soft tokens, an
RMSNorm over the vision width (Gemma's, 1 + w in float32) and one matrix into the text model's width
(transformers' Gemma3MultiModalProjector)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import UnsupportedModel
from engine.model.layers.norm import GemmaRMSNorm


class Gemma3Projector(nn.Module):
    """[images, patches_per_side^2, vision_hidden] -> [images, tokens_per_image, text_hidden]."""

    def __init__(
        self, *, vision_hidden: int, text_hidden: int, patches_per_side: int, tokens_per_image: int, eps: float
    ) -> None:
        super().__init__()
        side = math.isqrt(tokens_per_image)
        if side * side != tokens_per_image or patches_per_side % side:
            raise UnsupportedModel(
                f"mm_tokens_per_image {tokens_per_image} is not a square whose side divides the "
                f"vision tower's {patches_per_side} patches a side",
                param="model",
            )
        self.patches_per_side, self.kernel = patches_per_side, patches_per_side // side
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision_hidden, text_hidden))
        self.mm_soft_emb_norm = GemmaRMSNorm(vision_hidden, eps)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        b, _, d = features.shape
        side = self.patches_per_side
        grid = features.transpose(1, 2).reshape(b, d, side, side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return (self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight).to(features.dtype)
