"""Embedding and score requests: prompt-only work whose result is the model's final hidden states, pooled (and, for
a cross-encoder's score, read by its head: engine/model/classifier.py).

A PoolingParams request runs through the same scheduler and batches as generation, is never sampled, and gives
its pages back as soon as its prompt has run (full pages stay in the prefix cache for others). Its hidden rows
are folded in chunk by chunk (`fold`), so chunked prefill needs no more memory than one chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.classifier import ScoreHead, activate
from engine.model.pooling import PoolingConfig


@dataclass(kw_only=True)
class PoolingParams:
    """What one embedding request asks: the model's pooling, shortened to `dimensions` when given."""

    config: PoolingConfig
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None  # keep the prompt's last this many tokens
    head: ScoreHead | None = None  # a cross-encoder's score head (pooled hidden -> logits): a score, not an embedding
    activation: bool = True  # a score's labels through the classifier's activation (False: the raw logits)
    label_activation: str = "classify"  # which activation (engine.model.classifier.activate)
    # A text pair's segment of each prompt token (BERT's token_type_ids: 0 for the first text, 1 for the second)
    token_type_ids: list[int] | None = None
    # A group reads these of any request's parameters: an embedding is one sequence, no logprobs, no adapter.
    n: int = 1
    num_sequences: int = 1
    prompt_logprobs: None = None
    adapter: None = None
    priority: int = 0
    structured: None = None

    def segments(self, start: int, end: int) -> list[int]:
        """The token_type_ids of prompt positions [start, end): 0 where the request gives none."""
        return [0] * (end - start) if self.token_type_ids is None else self.token_type_ids[start:end]

    @property
    def needs_every_row(self) -> bool:
        """Mean and CLS pooling read rows a prefix-cache hit would skip; the last token is always run (an encoder's
        rows each see the whole prompt: none may be skipped)."""
        return self.config.method != "last" or self.config.whole_prompt


def fold(
    acc: torch.Tensor | None, rows: torch.Tensor, start: int, end: int, total: int, method: str
) -> torch.Tensor | None:
    """The running pooled state after the hidden `rows` of prompt positions [start, end) of `total`."""
    if method == "mean":
        part = rows.float().sum(0)
        return part if acc is None or start == 0 else acc + part  # start 0: a first run, or a rerun after preemption
    if method == "cls":
        return rows[0].float() if start == 0 else acc
    return rows[-1].float() if end == total else acc


def finish(acc: torch.Tensor, params: PoolingParams, total: int) -> list[float]:
    """The embedding: the mean taken, shortened to `dimensions`, then normalised when the model normalises; or a
    cross-encoder's label scores, its head applied to the pooled hidden state (a decoder's last token's, an
    encoder's first token's or, ModernBERT's mean pooling, the tokens' mean)."""
    if params.head is not None:
        pooled = acc / total if params.config.method == "mean" else acc
        logits = params.head(pooled.float())
        return (activate(logits, params.label_activation) if params.activation else logits).tolist()
    vector = acc / total if params.config.method == "mean" else acc
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.config.normalize:
        vector = torch.nn.functional.normalize(vector, dim=-1)
    return vector.tolist()
