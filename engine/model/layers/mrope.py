"""Multimodal rotary positions (Qwen2.5-VL, Qwen3-VL, Qwen3.5): a token has a temporal, a row and a column position,
and each rotary frequency reads one of them. Interleaved sections (transformers' Qwen3VLTextRotaryEmbedding):
frequency j reads the row position when j % 3 == 1 and j < 3 * section[1], the column one when j % 3 == 2 and
j < 3 * section[2], else the temporal one. Contiguous sections (Qwen2.5-VL's Qwen2_5_VLRotaryEmbedding): the first
section[0] frequencies read the temporal position, the next section[1] the row, the next section[2] the column.

Text tokens have all three positions equal, so a step without image tokens passes plain 1-D positions and the
tables read as ordinary rotary; a step with image tokens passes [3, tokens].
"""

from __future__ import annotations

import torch

from engine.errors import UnsupportedModel
from engine.model.layers.rotary import RotaryEmbedding


class MultimodalRotary(RotaryEmbedding):
    """RotaryEmbedding whose lookup also takes [3, T] (t, h, w) positions."""

    def __init__(
        self,
        *,
        rotary_dim: int,
        rope: dict,
        section: tuple[int, ...],
        interleaved: bool = True,
        max_position_embeddings: int,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(
            head_dim=rotary_dim,
            rope=rope,
            max_position_embeddings=max_position_embeddings,
            max_positions=max_positions,
            dtype=dtype,
            device=device,
        )
        half = rotary_dim // 2
        # NOTE: sections that do not sum to half the rotary width are transformers' business too: it slices them
        # over the frequencies there are, as here.
        if len(section) != 3:
            raise UnsupportedModel(f"mrope_section {list(section)} must be three numbers (t, h, w)", param="model")
        j = torch.arange(half)
        axis = torch.zeros(half, dtype=torch.long)
        if interleaved:
            axis[(j % 3 == 1) & (j < 3 * section[1])] = 1
            axis[(j % 3 == 2) & (j < 3 * section[2])] = 2
        else:
            # transformers cycles t, h, w over the sections it splits the frequencies into (a fourth would read t)
            bounds = torch.tensor(section).cumsum(0)
            axis = (torch.bucketize(j, bounds, right=True) % 3).long()
        self.axis = axis.to(device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().lookup(positions)
        index = self.axis.expand(1, positions.shape[1], -1)
        assert self.cos is not None and self.sin is not None, "the unfused tables (fused rotary has cos_sin_cache)"
        cos = self.cos[positions].gather(0, index)[0]  # [T, half]: each frequency from its axis' position
        sin = self.sin[positions].gather(0, index)[0]
        return cos.unsqueeze(1), sin.unsqueeze(1)
