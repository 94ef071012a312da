"""Paged attention in plain torch: FlashInfer's semantics, the CPU product path and the GPU oracle.

plan() turns the CSR page table into gather indices once per step. Single-token (decode) requests are
batched: sorted by KV length into a few buckets, each bucket's KV is gathered into one padded
[B, max_kv_len] block and attended with one SDPA call under a length mask, the GQA group folded into the
query rows. Longer (prefill) requests run one SDPA call each, causal with the query offset.

Sink logits (gpt-oss), given per layer to run(), join every query's softmax as one more key with no value
(engine.attention.sinks).

An FP8 KV cache (engine.attention.kv_quant) is quantised on write and dequantised on read: the gathered rows are
cast to the query's dtype and multiplied by the layer's k_scale / v_scale, so SDPA runs as with a float cache.

An image's tokens on Gemma 3 attend to each other both ways (AttentionMetadata.bidirectional): their prefill
rows get the mask of engine.attention.masks. A decode row is a generated token, never an image's.

With a sliding window of W tokens (a query at position i sees keys j with i - W < j <= i), plan() gathers only
the keys some query of the request can see, so pages that fell out of every query's window (a window group's
NULL page) are never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata
from engine.attention.kv_quant import dequantize, write_slots
from engine.attention.masks import prefill_mask
from engine.attention.sinks import sdpa_with_sink

# A decode bucket costs about as much fixed work (a gather and an SDPA call) as this many padded KV rows;
# splitting the sorted requests is worth it when it saves more padding than that.
BUCKET_OVERHEAD_ROWS = 512
MAX_BUCKET_DEPTH = 2  # split twice at most: up to 4 buckets


def _head_rows(slots: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Rows of the pool seen as [slots * kv_heads, head_dim] that gather slots [..., L] as [..., Hk, L, D].

    NOTE: gathering head-major rows makes K/V contiguous for SDPA, which is ~2x faster than handing it
    the transposed NHD gather.
    """
    heads = torch.arange(num_kv_heads, device=slots.device)
    return (slots.unsqueeze(-2) * num_kv_heads + heads[:, None]).flatten()


@dataclass
class _Prefill:
    rows: slice  # the request's query rows in the flattened batch
    slots: torch.Tensor  # [kv_len] flat pool slots (page * page_size + offset)
    mask: torch.Tensor | None  # [q_len, kv_len] bool, None when q_len == kv_len (plain causal)
    gather: torch.Tensor | None = None  # _head_rows(slots), built by the step's first run()


@dataclass
class _Decode:
    rows: torch.Tensor | None  # query rows of this bucket's requests; None: all rows of the step, in order
    slots: torch.Tensor  # [B, max_kv_len] flat pool slots; padding repeats each request's last slot
    mask: torch.Tensor | None  # [B, 1, 1, max_kv_len] bool; None when every kv_len is equal
    gather: torch.Tensor | None = None  # _head_rows(slots), built by the step's first run()


class TorchRefBackend:
    """AttentionBackend over the NHD paged pool using torch.nn.functional.scaled_dot_product_attention."""

    def __init__(
        self,
        device: torch.device | str = "cpu",
        *,
        window: int | None = None,
        scale: float | None = None,
        soft_cap: float | None = None,
        **_: object,
    ) -> None:
        self.device = torch.device(device)
        self.window = window
        self.scale = scale  # None: 1/sqrt(head_dim)
        self.soft_cap = soft_cap  # scores become soft_cap * tanh(scores / soft_cap) before the mask
        self._slots: torch.Tensor | None = None
        self._decodes: list[_Decode] = []
        self._prefills: list[_Prefill] = []

    def plan(self, meta: AttentionMetadata) -> None:
        ps = meta.page_size
        qo = meta.qo_indptr.tolist()
        kv = meta.kv_indptr.tolist()
        last = meta.kv_last_page_len.tolist()
        indices = meta.kv_indices.to(torch.long)
        self._slots = meta.slot_mapping.to(torch.long)
        decode_ids: list[int] = []
        self._prefills = []
        for i in range(len(qo) - 1):
            q_len, kv_len = qo[i + 1] - qo[i], (kv[i + 1] - kv[i] - 1) * ps + last[i]
            if q_len == 1:
                decode_ids.append(i)
                continue
            mask = None
            lo = 0 if self.window is None else max(0, kv_len - q_len - self.window + 1)
            cols = torch.arange(lo, kv_len, device=self.device)
            spans = meta.bidirectional[i] if meta.bidirectional else None
            if q_len != kv_len or self.window is not None or spans:
                mask = prefill_mask(q_len, kv_len, lo, self.window, spans, self.device)
            slots = indices[kv[i] + cols // ps] * ps + cols % ps
            self._prefills.append(_Prefill(slice(qo[i], qo[i + 1]), slots, mask))
        self._decodes = self._plan_decodes(decode_ids, qo, kv, last, indices, ps) if decode_ids else []

    def _plan_decodes(
        self, ids: list[int], qo: list[int], kv: list[int], last: list[int], indices: torch.Tensor, ps: int
    ) -> list[_Decode]:
        # lens: the keys each request's query sees (its last `window` ones at most), ending at its KV's end.
        full = {i: (kv[i + 1] - kv[i] - 1) * ps + last[i] for i in ids}
        lens = full if self.window is None else {i: min(n, self.window) for i, n in full.items()}
        skip = None if self.window is None else {i: full[i] - lens[i] for i in ids}
        ordered = sorted(ids, key=lens.__getitem__)
        spans = _split([lens[i] for i in ordered], 0, len(ordered), MAX_BUCKET_DEPTH)
        if len(spans) == 1 and len(ids) == len(qo) - 1:
            return [self._plan_decode(ids, lens, skip, None, kv, indices, ps)]
        buckets = [ordered[lo:hi] for lo, hi in spans]
        return [
            self._plan_decode(b, lens, skip, torch.tensor([qo[i] for i in b], device=self.device), kv, indices, ps)
            for b in buckets
        ]

    def _plan_decode(
        self,
        ids: list[int],
        all_lens: dict[int, int],
        skip: dict[int, int] | None,
        rows: torch.Tensor | None,
        kv: list[int],
        indices: torch.Tensor,
        ps: int,
    ) -> _Decode:
        dev = self.device
        kv_lens = [all_lens[i] for i in ids]
        max_len = max(kv_lens)
        lens = torch.tensor(kv_lens, device=dev)
        starts = torch.tensor([kv[i] for i in ids], device=dev)
        # NOTE: padding repeats the request's last token, so only written slots are read: a stale or NaN
        # slot would poison the softmax even under a mask (0 * NaN).
        t = torch.minimum(torch.arange(max_len, device=dev)[None, :], lens[:, None] - 1)
        if skip is not None:
            t = t + torch.tensor([skip[i] for i in ids], device=dev)[:, None]
        slots = indices[starts[:, None] + t // ps] * ps + t % ps
        mask = None
        if min(kv_lens) != max_len:
            mask = (torch.arange(max_len, device=dev)[None, :] < lens[:, None])[:, None, None, :]
        return _Decode(rows, slots, mask)

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        assert self._slots is not None, "write_kv runs after plan"
        write_slots(k, k_cache, self._slots, k_scale)
        write_slots(v, v_cache, self._slots, v_scale)

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        sinks: torch.Tensor | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """As AttentionBackend.run; sinks: the layer's sink logits [q_heads] (gpt-oss), or None."""
        if sinks is not None and self.soft_cap is not None:
            raise ValueError("attention sinks with a logit soft-cap are not implemented")
        scales = (k_scale, v_scale)
        if len(self._decodes) == 1 and self._decodes[0].rows is None:
            return self._run_decode(q, k_cache, v_cache, self._decodes[0], sinks, scales)
        out = torch.empty_like(q)
        for d in self._decodes:
            assert d.rows is not None, "a decode group in a mixed batch names its rows"
            out.index_copy_(0, d.rows, self._run_decode(q.index_select(0, d.rows), k_cache, v_cache, d, sinks, scales))
        for p in self._prefills:
            out[p.rows] = self._run_prefill(q[p.rows], k_cache, v_cache, p, sinks, scales)
        return out

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        causal: bool = False,
        enable_gqa: bool = False,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """SDPA; with sinks one more key (engine.attention.sinks); with a soft-cap (which SDPA lacks) the same
        math spelled out as transformers' eager path."""
        if sinks is not None:
            if causal:  # SDPA's is_causal would hide the sink key, which comes last
                t = q.shape[-2]
                mask = torch.ones(t, k.shape[-2], dtype=torch.bool, device=q.device).tril(k.shape[-2] - t)
            return sdpa_with_sink(q, k, v, mask, sinks, enable_gqa=enable_gqa, scale=self.scale)
        if self.soft_cap is None:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=enable_gqa
            )
        return soft_capped_attention(q, k, v, mask, causal, self.scale, self.soft_cap)

    def _run_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: _Decode,
        sinks: torch.Tensor | None,
        scales: tuple[float, float],
    ) -> torch.Tensor:
        b, hq, d = q.shape
        hk = k_cache.shape[2]
        if plan.gather is None:
            plan.gather = _head_rows(plan.slots, hk)
        k = dequantize(k_cache.view(-1, d).index_select(0, plan.gather), q.dtype, scales[0]).view(b, hk, -1, d)
        v = dequantize(v_cache.view(-1, d).index_select(0, plan.gather), q.dtype, scales[1]).view(b, hk, -1, d)
        # The GQA group becomes the query rows: q [B, Hk, group, D] against K/V [B, Hk, L, D].
        out = self._attend(
            q.view(b, hk, hq // hk, d), k, v, plan.mask, sinks=None if sinks is None else sinks.view(hk, hq // hk)
        )
        return out.reshape(b, hq, d)

    def _run_prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: _Prefill,
        sinks: torch.Tensor | None,
        scales: tuple[float, float],
    ) -> torch.Tensor:
        hk, d = k_cache.shape[2], k_cache.shape[3]
        if plan.gather is None:
            plan.gather = _head_rows(plan.slots, hk)
        k = dequantize(k_cache.view(-1, d).index_select(0, plan.gather), q.dtype, scales[0]).view(hk, -1, d)
        v = dequantize(v_cache.view(-1, d).index_select(0, plan.gather), q.dtype, scales[1]).view(hk, -1, d)
        # NOTE: 4-D inputs: with 3-D ones CPU SDPA takes the math path (materialised scores, ~4x slower).
        out = self._attend(
            q.transpose(0, 1)[None],
            k[None],
            v[None],
            plan.mask,
            causal=plan.mask is None,
            enable_gqa=True,
            sinks=None if sinks is None else sinks.view(-1, 1),
        )
        return out[0].transpose(0, 1)


def soft_capped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float | None,
    soft_cap: float,
) -> torch.Tensor:
    """SDPA's contract (q [..., Hq, T, D], k/v [..., Hk, L, D], GQA by head groups, bool mask or causal) with
    the scores capped at soft_cap * tanh(scores / soft_cap); softmax in float32 as transformers does."""
    *lead, hq, t, d = q.shape
    hk, length = k.shape[-3], k.shape[-2]
    qg = q.reshape(*lead, hk, hq // hk, t, d)
    scores = qg @ k.unsqueeze(-3).transpose(-1, -2) * (d**-0.5 if scale is None else scale)
    scores = torch.tanh(scores / soft_cap) * soft_cap
    if causal:
        mask = torch.ones(t, length, dtype=torch.bool, device=q.device).tril(length - t)
    if mask is not None:
        # A [B, 1, 1, L] decode mask gets a query axis; a [T, L] prefill mask broadcasts as it is.
        scores = scores.masked_fill(~(mask.unsqueeze(-2) if mask.dim() == 4 else mask), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return (probs @ v.unsqueeze(-3)).reshape(*lead, hq, t, d)


def _split(lens: list[int], lo: int, hi: int, depth: int) -> list[tuple[int, int]]:
    """Spans of ascending `lens[lo:hi]` whose padded KV (size x longest) plus a fixed cost per span is least.

    Bisects at the best single cut, `depth` times at most.
    """
    best, cut = (hi - lo) * lens[hi - 1], None
    if depth > 0:
        for i in range(lo + 1, hi):
            cost = (i - lo) * lens[i - 1] + (hi - i) * lens[hi - 1] + BUCKET_OVERHEAD_ROWS
            if cost < best:
                best, cut = cost, i
    if cut is None:
        return [(lo, hi)]
    return _split(lens, lo, cut, depth - 1) + _split(lens, cut, hi, depth - 1)
