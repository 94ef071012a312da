"""Multi-head latent attention (DeepSeek's MLA) over latent pages, in plain torch: the torch reference's plan
(decode buckets, causal prefill) over an MLA group's pages, which hold per token the compressed latent c
(kv_lora_rank values) and the rotary key part k_pe, not K and V of every head.

With the absorbed weights it is multi-query attention with one KV "head" of kv_lora_rank + rope_dim values whose
value is the latent itself: the model folds W_UK into the query (q_latent = q_nope @ W_UK_h per head), attends with
[q_latent, q_pe] against [c, k_pe], and takes the output latent through W_UV_h (engine/model/layers/mla.py). The
scale is the model's (1/sqrt(qk_nope + qk_rope), times DeepSeek's YaRN mscale squared), never 1/sqrt(row width).

run_mla() takes the un-absorbed query and the head weights and returns every head's value: decode rows (and short
chunks) in the absorbed form, a prefill chunk of many rows in the plain form (per head K = [c W_UK_h^T, k_pe],
V = c W_UV_h^T, expanded from the gathered latents), which costs fewer multiplies there (plain_prefill()); the two
are held equal by tests/engine/attention/test_mla.py.

The pages are the pair (ckv [pages, page_size, kv_lora_rank], kpe [pages, page_size, rope_dim]), FlashInfer's
BatchMLAPagedAttentionWrapper layout, which engine/attention/flashinfer_mla.py runs on CUDA for the shapes it serves.
FP8 pages (KV_CACHE_DTYPE=fp8) hold each latent and rotary key value in e4m3 at scale 1 (the latent is RMS-normed,
so its values sit well inside +-448; anything beyond saturates), cast back to the query's dtype when gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.kv_quant import FP8, FP8_MAX, dequantize, is_fp8
from engine.attention.torch_ref import TorchRefBackend, _Decode, _Prefill


class TorchMLABackend(TorchRefBackend):
    """AttentionBackend over latent pages: write_kv(c, k_pe, ckv, kpe), run(q, ckv, kpe) with q [T, H, rank + rope]
    (the absorbed q_latent, then q_pe) -> the output latents [T, H, rank]."""

    def __init__(
        self,
        device: torch.device | str = "cpu",
        *,
        scale: float | None = None,
        plain_prefill: bool | None = None,
        **_: object,
    ) -> None:
        if scale is None:
            raise ValueError("multi-head latent attention needs the model's softmax scale")
        super().__init__(device, scale=scale)
        self.plain_prefill = plain_prefill  # None: by cost (plain_prefill()); True / False: always / never

    def run_mla(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        ckv: torch.Tensor,
        kpe: torch.Tensor,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
    ) -> torch.Tensor:
        """q_nope [T, H, nope], q_pe [T, H, rope] (rotated); w_uk [H, nope, rank], w_uv [H, v, rank] (kv_b_proj's
        rows per head). Returns each head's attention value [T, H, v]."""
        values = q_nope.new_empty(*q_nope.shape[:2], w_uv.shape[1])
        for d in self._decodes:
            rows = slice(None) if d.rows is None else d.rows
            q = torch.cat((absorb(q_nope[rows], w_uk), q_pe[rows]), dim=-1)
            values[rows] = expand(self._mla_decode(q, ckv, kpe, d), w_uv)
        for p in self._prefills:
            qn, qp = q_nope[p.rows], q_pe[p.rows]
            if plain_prefill(qn.shape[0], ckv.shape[-1], w_uk.shape[1], w_uv.shape[1], self.plain_prefill):
                values[p.rows] = self._plain_prefill(qn, qp, ckv, kpe, p, w_uk, w_uv)
            else:
                q = torch.cat((absorb(qn, w_uk), qp), dim=-1)
                values[p.rows] = expand(self._mla_prefill(q, ckv, kpe, p), w_uv)
        return values

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """k: the step's latents [T, kv_lora_rank] into ckv `k_cache`; v: their rotary key parts [T, rope_dim] into
        kpe `v_cache` (views of one row store: view() flattens the page axes without a copy)."""
        slots = self._slots
        assert slots is not None, "plan() was not called"
        write_latents(k, v, k_cache, v_cache, slots)

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        sinks: torch.Tensor | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        if sinks is not None:
            raise ValueError("attention sinks with multi-head latent attention are not implemented")
        rank = k_cache.shape[-1]
        if len(self._decodes) == 1 and self._decodes[0].rows is None:
            return self._mla_decode(q, k_cache, v_cache, self._decodes[0])
        out = q.new_empty(*q.shape[:2], rank)
        for d in self._decodes:
            assert d.rows is not None  # a bucket of some of the step's rows
            out.index_copy_(0, d.rows, self._mla_decode(q.index_select(0, d.rows), k_cache, v_cache, d))
        for p in self._prefills:
            out[p.rows] = self._mla_prefill(q[p.rows], k_cache, v_cache, p)
        return out

    def latents(self, ckv: torch.Tensor, kpe: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The rows [c, k_pe] of flat pool `slots` (any shape) as [*slots.shape, rank + rope] in `dtype` (FP8 pages
        cast back), in one tensor."""
        flat = slots.reshape(-1)
        c = dequantize(ckv.view(-1, ckv.shape[-1]).index_select(0, flat), dtype)
        pe = dequantize(kpe.view(-1, kpe.shape[-1]).index_select(0, flat), dtype)
        return torch.cat((c, pe), dim=-1).view(*slots.shape, -1)

    def _mla_decode(self, q: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor, plan: _Decode) -> torch.Tensor:
        b, h, _ = q.shape
        k = self.latents(ckv, kpe, plan.slots, q.dtype)[:, None]  # [B, 1, L, rank + rope]: one KV head for all
        out = F.scaled_dot_product_attention(
            q[:, None], k, k[..., : ckv.shape[-1]], attn_mask=plan.mask, scale=self.scale
        )  # the heads are the query rows of the one KV head: [B, 1, H, rank]
        return out.view(b, h, -1)

    def _mla_prefill(self, q: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor, plan: _Prefill) -> torch.Tensor:
        k = self.latents(ckv, kpe, plan.slots, q.dtype)[None, None]  # [1, 1, L, rank + rope]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k,
            k[..., : ckv.shape[-1]],
            attn_mask=plan.mask,
            is_causal=plan.mask is None,
            scale=self.scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)

    def _plain_prefill(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        ckv: torch.Tensor,
        kpe: torch.Tensor,
        plan: _Prefill,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
    ) -> torch.Tensor:
        """Every head's K and V expanded from the request's latents, then causal attention as transformers runs it."""
        rows = self.latents(ckv, kpe, plan.slots, q_nope.dtype)  # [L, rank + rope]
        latent, k_pe = rows[:, : ckv.shape[-1]], rows[:, ckv.shape[-1] :]
        heads = q_nope.shape[1]
        k = torch.cat((latent @ w_uk.transpose(1, 2), k_pe.expand(heads, -1, -1)), dim=-1)  # [H, L, nope + rope]
        v = latent @ w_uv.transpose(1, 2)  # [H, L, v]
        q = torch.cat((q_nope, q_pe), dim=-1).transpose(0, 1)  # [H, T, nope + rope]
        out = F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=plan.mask, is_causal=plan.mask is None, scale=self.scale
        )
        return out[0].transpose(0, 1)


def write_latents(
    latent: torch.Tensor, k_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor, slots: torch.Tensor
) -> None:
    """Each new token's latent and rotary key part into flat pool `slots` of the ckv and kpe pages (views of one row
    store: view() flattens the page axes without a copy); FP8 pages take them saturated at +-448."""
    for rows, cache in ((latent, ckv), (k_pe, kpe)):
        flat, rows = cache.view(-1, cache.shape[-1]), rows.reshape(-1, cache.shape[-1])
        if is_fp8(cache):  # torch has no index_copy_ for float8 on CPU: the same bytes through uint8 views
            fp8 = rows.float().clamp(-FP8_MAX, FP8_MAX).to(FP8)
            flat.view(torch.uint8).index_copy_(0, slots, fp8.view(torch.uint8))
        else:
            flat.index_copy_(0, slots, rows)


def absorb(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_latent [T, H, rank] = q_nope_h @ W_UK_h per head (w_uk [H, nope, rank])."""
    return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)


def expand(latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Each head's value [T, H, v] from its output latent [T, H, rank] (w_uv [H, v, rank])."""
    return torch.bmm(latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def plain_prefill(rows: int, rank: int, nope: int, v: int, forced: bool | None) -> bool:
    """Whether a prefill chunk of `rows` queries runs the plain form: per key, the absorbed form scores and sums
    2 * rank + rope values per query, the plain one nope + rope + v but first expands the key's latent for every head
    (rank * (nope + v)); plain wins when rows * (2 * rank - nope - v) > rank * (nope + v)."""
    return forced if forced is not None else rows * (2 * rank - nope - v) > rank * (nope + v)
