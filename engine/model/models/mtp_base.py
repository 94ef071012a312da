"""What the multi-token-prediction heads checkpoints ship share (Qwen3.5 / Qwen3-Next's mtp.*, DeepSeek-V3 and
GLM-4.5's next-n layer): at position p the embedding of token p+1 and the target's final hidden state of p, each
through its own norm, concatenated in that order and projected back to the hidden size, then one decoder layer of
the family. The target (whose embedding, rotary and maybe lm_head the head reads) is shared, not a submodule.

A head runs on the engine's ModelRunner like any model: the caller sets `features` (one row per input token) before
each forward and reads `carry` after it, the rows its next step reads in place of the target's hidden states.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata


class MtpHeadBase(nn.Module):
    """A subclass builds its norms, projection and layer under the checkpoint's names and says how they run
    (join(), decode())."""

    def __init__(self, args: Any, target: Any) -> None:
        super().__init__()
        self.args = args
        self._target: tuple[Any] = (target,)  # a tuple: shared, not a submodule (its weights are the target's to load)
        self.lora = None
        self.features: torch.Tensor | None = None  # set by the caller before each forward: a row per token
        self.carry: torch.Tensor | None = None  # each row's output for the head's next step, after a forward

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings: the target's, unless the head has its own."""
        return self._target[0].model.embed_tokens(input_ids)

    def join(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The projection of the normed embeddings and normed features, side by side."""
        raise NotImplementedError

    def decode(
        self, x: torch.Tensor, positions: torch.Tensor, caches: tuple[torch.Tensor, torch.Tensor], b: AttentionBackend
    ) -> torch.Tensor:
        """The decoder layer on x: the rows its next step reads (and compute_logits() is given)."""
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend | list[AttentionBackend],
    ) -> torch.Tensor:
        assert self.features is not None, "features are set before each forward"
        embeds = self.embed(input_ids)
        x = self.join(embeds, self.features.to(embeds.dtype))
        self.carry = self.decode(x, positions, kv_caches[0], backend[0] if isinstance(backend, list) else backend)
        return self.carry

    def compute_logits(self, hidden: torch.Tensor, exact_rows: torch.Tensor | None = None) -> torch.Tensor:
        return self._target[0].compute_logits(hidden, exact_rows)
