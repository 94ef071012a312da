"""The attention backend contract: FlashInfer's paged KV layout and CSR page table, planned once per step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(kw_only=True)
class AttentionMetadata:
    """One step's batch, as the CSR arrays FlashInfer takes (all int32, on the model's device).

    Request i owns query rows qo_indptr[i]:qo_indptr[i+1] of the flattened batch and KV pages
    kv_indices[kv_indptr[i]:kv_indptr[i+1]]; its last page holds kv_last_page_len[i] tokens.
    The KV of the step's own tokens is already written into the pool when run() is called, so
    request i attends to kv_len_i = (num_pages_i - 1) * page_size + last_len_i tokens, and its
    query row j sits at absolute position kv_len_i - q_len_i + j (causal from there).
    """

    qo_indptr: torch.Tensor  # [batch + 1]
    kv_indptr: torch.Tensor  # [batch + 1]
    kv_indices: torch.Tensor  # [kv_indptr[-1]]
    kv_last_page_len: torch.Tensor  # [batch]
    slot_mapping: torch.Tensor  # [num_tokens] int64: page * page_size + offset where each new token's KV goes
    page_size: int
    is_decode: bool  # every request has exactly one query token
    # Per request, the [start, end) positions whose tokens attend to each other both ways (an image's soft tokens
    # on Gemma 3; engine/attention/masks.py); None when no request of the step has any. A step's chunk never ends
    # inside such a span (the scheduler keeps each whole), so every key the span's queries see is in the KV.
    bidirectional: list[list[tuple[int, int]]] | None = None


def warmup_steps(page_size: int, device: torch.device) -> tuple[AttentionMetadata, AttentionMetadata]:
    """A backend's warm-up: one request's prefill of page_size + 1 tokens over pages 0 and 1 (the second partly
    filled), then its decode of one more token, so a JIT build happens at start-up rather than on a request."""
    n = page_size + 1
    prefill = AttentionMetadata(
        qo_indptr=torch.tensor([0, n], dtype=torch.int32, device=device),
        kv_indptr=torch.tensor([0, 2], dtype=torch.int32, device=device),
        kv_indices=torch.tensor([0, 1], dtype=torch.int32, device=device),
        kv_last_page_len=torch.tensor([1], dtype=torch.int32, device=device),
        slot_mapping=torch.arange(n, device=device),
        page_size=page_size,
        is_decode=False,
    )
    decode = AttentionMetadata(
        qo_indptr=torch.tensor([0, 1], dtype=torch.int32, device=device),
        kv_indptr=prefill.kv_indptr,
        kv_indices=prefill.kv_indices,
        kv_last_page_len=torch.tensor([2], dtype=torch.int32, device=device),
        slot_mapping=torch.tensor([n], device=device),
        page_size=page_size,
        is_decode=True,
    )
    return prefill, decode


class AttentionBackend(Protocol):
    """plan() once per step, then write_kv() and run() once per layer."""

    def plan(self, meta: AttentionMetadata) -> None: ...

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """Store the step's new k, v ([num_tokens, kv_heads, head_dim]) at the planned slots; into FP8 pages as
        k / k_scale and v / v_scale (the layer's KV scales; ignored by pages in the model's dtype)."""
        ...

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        sinks: torch.Tensor | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """q: [num_tokens, q_heads, head_dim]; caches: [pages, page_size, kv_heads, head_dim] (NHD).

        Returns [num_tokens, q_heads, head_dim]. Scale is 1/sqrt(head_dim); GQA when q_heads > kv_heads.
        sinks: the layer's learned sink logits [q_heads] (gpt-oss), one more softmax term with no value.
        k_scale, v_scale: FP8 pages hold K / k_scale and V / v_scale (the same scales write_kv was given).
        """
        ...


class LatentAttentionBackend(AttentionBackend, Protocol):
    """A multi-head latent attention (MLA) group's backend: write_kv(latent, k_pe, ckv, kpe) stores each token's
    row, and run_mla() attends over those rows with the head weights (engine/attention/mla.py)."""

    def run_mla(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        ckv: torch.Tensor,
        kpe: torch.Tensor,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
    ) -> torch.Tensor:
        """q_nope [T, H, nope], q_pe [T, H, rope]; w_uk [H, nope, rank], w_uv [H, v, rank]. Returns [T, H, v]."""
        ...
