"""Tensor-parallel building blocks: a rank's place in its group, the collectives a sharded model runs (the
all-reduce after a row-parallel block, the gather of vocab-parallel logits) and the vocab-parallel embedding.

Sharding splits what the checkpoint stores: heads and intermediate columns (column-parallel: no communication),
the projections back to the hidden size (row-parallel: each rank's partial sum, all-reduced once per block), and
the vocabulary rows of the embedding and the lm_head. engine/model/sharding.py decides which slice each rank reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place among `size` ranks and the process group its collectives run on (the model's device)."""

    rank: int
    size: int
    group: Any = None  # torch.distributed.ProcessGroup

    def span(self, total: int) -> tuple[int, int]:
        """(start, size) of this rank's equal part of `total` (which the start-up checks found divisible)."""
        part = total // self.size
        return self.rank * part, part

    def kv_heads(self, total: int) -> tuple[int, int]:
        """(first, count) of the KV heads this rank holds: an equal part, or, with fewer KV heads than ranks, the
        one head its query heads read (each KV head then replicated on size // total ranks)."""
        if total >= self.size:
            return self.span(total)
        return self.rank // (self.size // total), 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums the ranks' partial results in place (every rank gets the sum)."""
        dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Each rank's vocabulary columns [rows, vocab / size] -> on rank 0 the whole [rows, vocab] (the others get
        their own part back: only rank 0 samples)."""
        logits = logits.contiguous()
        if self.rank != 0:
            dist.gather(logits, None, dst=0, group=self.group)
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        dist.gather(logits, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1)


class VocabParallelEmbedding(nn.Embedding):
    """The rows [start, start + num_embeddings) of an embedding table: ids outside them embed to zeros here, and
    the all-reduce over the ranks gives every id its row."""

    def __init__(self, num_embeddings: int, embedding_dim: int, start: int, tp: TensorParallel) -> None:
        super().__init__(num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim))
        self.start, self.tp = start, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        h.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(h)


class ParallelRMSNorm(nn.Module):
    """An RMSNorm over a dimension split across the ranks (OLMoE's q / k norm spans every head): this rank's slice
    of the weight, and the mean square from the ranks' summed squares, so each rank normalises its columns as one
    rank would the whole row. A head replicated on r ranks (fewer KV heads than ranks) counts r times in the sum,
    and the whole row is r times wider than the heads it has: dividing by `local width * size` covers both."""

    def __init__(self, dim: int, eps: float, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.tp = eps, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        # NOTE: one [tokens, 1] all-reduce, not a gather of the whole projection as vLLM's OLMoE does.
        squares = self.tp.all_reduce(x32.pow(2).sum(-1, keepdim=True))
        normed = x32 * torch.rsqrt(squares / (x.shape[-1] * self.tp.size) + self.eps)
        return self.weight * normed.to(x.dtype)  # as RMSNorm: normalise in float32, scale in the model dtype
