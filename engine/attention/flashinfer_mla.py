"""Multi-head latent attention (MLA) on CUDA through FlashInfer's BatchMLAPagedAttentionWrapper, over an MLA group's
latent pages (ckv [pages, page_size, kv_lora_rank], kpe [pages, page_size, rope_dim]), planned once per step.

Pinned to flashinfer-python 0.5.3 (requirements-cuda.txt), imported lazily. The kernel runs the absorbed form only:
every head's query latent (q_nope through W_UK_h) and rotary part attend against the one row per token that every
head shares, and the output is a latent per head. run_mla() folds W_UK into the query before the kernel and takes
the latents through W_UV after, as the torch reference's decode path does (engine/attention/mla.py), for prefill
chunks too (the kernel has no plain form). The softmax scale is the model's, never 1/sqrt of the row width.

What it serves: engine.cuda.kernels.FLASHINFER_MLA_SHAPES (DeepSeek's 512 + 64) in float16 / bfloat16, pages of the
model's dtype (start-up refuses FP8 pages for MLA), any head count and page size, int32 page tables; FA2 kernels
(kernels.MLA_BACKEND). engine.attention.group_backends sends any other MLA group to the torch reference. Decode runs
eagerly (no graph_decode: CUDA graphs are not captured for an MLA group yet).

Every call into FlashInfer passes its arguments by keyword (tests/engine/cuda/test_library_calls.py).
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionMetadata, warmup_steps
from engine.attention.mla import absorb, expand, write_latents
from engine.cuda.kernels import HALF_DTYPES, MLA_BACKEND

# FlashInfer's recommended size. The MLA plan's split-KV partials take 2 x SMs x 128 rows x (kv_lora_rank x 2 + 4)
# bytes at most: 35 MiB for 132 SMs at 512.
WORKSPACE_BYTES = 128 * 1024 * 1024
# MLAPlan (include/flashinfer/attention/scheduler.cuh) lays its work lists out for at most 16,384 works and does not
# check it; a step's works are its (64-row tile of query rows x heads, KV chunk) pairs: at most one tile per 64
# packed rows, one more per request, and the split chunks (fewer than the SMs, MAX_SMS on any GPU it runs on).
MAX_WORKS = 16384
TILE_ROWS = 64
MAX_SMS = 256


def max_step_tokens(num_heads: int, batch: int = 1) -> int:
    """The most query tokens one step of `batch` requests may plan with `num_heads` heads (MAX_WORKS)."""
    return (MAX_WORKS - MAX_SMS - batch) * TILE_ROWS // num_heads


class FlashInferMLABackend:
    """LatentAttentionBackend on FlashInfer's MLA paged attention: write_kv(c, k_pe, ckv, kpe), run(q, ckv, kpe) with
    the absorbed q [T, H, rank + rope] -> the output latents [T, H, rank], and run_mla() with the head weights."""

    name = "flashinfer"

    def __init__(
        self,
        *,
        device: torch.device | str = "cuda",
        num_heads: int,
        kv_lora_rank: int,
        rope_dim: int,
        dtype: torch.dtype,
        scale: float | None,
        workspace_bytes: int = WORKSPACE_BYTES,
        **_: object,
    ) -> None:
        import flashinfer

        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"FlashInfer's multi-head latent attention needs a CUDA device, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if dtype not in HALF_DTYPES:
            raise ValueError(f"FlashInfer's multi-head latent attention needs float16 or bfloat16, got {dtype}")
        if scale is None:
            raise ValueError("multi-head latent attention needs the model's softmax scale")
        self.num_heads, self.kv_lora_rank, self.rope_dim = num_heads, kv_lora_rank, rope_dim
        self.dtype, self.scale = dtype, scale
        # Zeroed, as the other FlashInfer wrappers' float workspace (engine.attention.flashinfer).
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
            float_workspace_buffer=self.workspace, backend=MLA_BACKEND
        )
        self._meta: AttentionMetadata | None = None

    def plan(self, meta: AttentionMetadata) -> None:
        """Plans the step: each request's KV length from its pages, causal from the end of its KV for prefill chunks
        (a decode row sees all of it, unmasked)."""
        if meta.bidirectional:
            raise ValueError("bidirectional attention spans are not implemented with multi-head latent attention")
        tokens, batch = meta.slot_mapping.numel(), meta.kv_last_page_len.shape[0]
        if tokens > max_step_tokens(self.num_heads, batch):
            raise ValueError(
                f"a step of {tokens} tokens over {self.num_heads} heads is more than FlashInfer's MLA plan holds "
                f"({max_step_tokens(self.num_heads, batch)}): lower max_num_batched_tokens"
            )
        self._meta = meta
        kv_len = (meta.kv_indptr[1:] - meta.kv_indptr[:-1] - 1) * meta.page_size + meta.kv_last_page_len
        self._wrapper.plan(
            qo_indptr=meta.qo_indptr,
            kv_indptr=meta.kv_indptr,
            kv_indices=meta.kv_indices,
            kv_len_arr=kv_len.to(torch.int32),
            num_heads=self.num_heads,
            head_dim_ckv=self.kv_lora_rank,
            head_dim_kpe=self.rope_dim,
            page_size=meta.page_size,
            causal=not meta.is_decode,
            sm_scale=self.scale,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )

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
        kpe `v_cache`, at the planned slots."""
        assert self._meta is not None, "plan() was not called for this step"
        write_latents(k, v, k_cache, v_cache, self._meta.slot_mapping)

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        sinks: torch.Tensor | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """q: the absorbed queries [T, H, rank + rope] (q_latent, then q_pe). Returns the latents [T, H, rank]."""
        if sinks is not None:
            raise ValueError("attention sinks with multi-head latent attention are not implemented")
        rank = k_cache.shape[-1]
        return self._attend(q[..., :rank], q[..., rank:], k_cache, v_cache)

    def run_mla(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        ckv: torch.Tensor,
        kpe: torch.Tensor,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
    ) -> torch.Tensor:
        """q_nope [T, H, nope], q_pe [T, H, rope] (rotated); w_uk [H, nope, rank], w_uv [H, v, rank]. Returns each
        head's attention value [T, H, v]."""
        return expand(self._attend(absorb(q_nope, w_uk), q_pe, ckv, kpe), w_uv)

    def _attend(self, q_latent: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor) -> torch.Tensor:
        assert self._meta is not None, "plan() was not called for this step"
        if q_latent.dtype != self.dtype or ckv.dtype != self.dtype:
            raise ValueError(f"planned for {self.dtype}, got queries in {q_latent.dtype} and pages in {ckv.dtype}")
        # NOTE: the kernel takes any row and head strides (the absorbed query is a transposed bmm result) but reads
        # each row's values contiguously.
        q_latent = q_latent if q_latent.stride(-1) == 1 else q_latent.contiguous()
        q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
        return self._wrapper.run(q_nope=q_latent, q_pe=q_pe, ckv_cache=ckv, kpe_cache=kpe)

    def warmup(self, page_size: int, sinks: bool = False) -> None:
        """Runs one tiny prefill and one decode on scratch pages, so the JIT build happens now, not on a request."""
        if sinks:
            raise ValueError("attention sinks with multi-head latent attention are not implemented")
        dev = self.device
        rank, width = self.kv_lora_rank, self.kv_lora_rank + self.rope_dim
        rows = torch.zeros(2, page_size, width, dtype=self.dtype, device=dev)
        ckv, kpe = rows[..., :rank], rows[..., rank:]
        prefill, decode = warmup_steps(page_size, dev)
        for meta in (prefill, decode):
            t = meta.slot_mapping.numel()
            latent = torch.randn(t, width, dtype=self.dtype, device=dev)
            self.plan(meta)
            self.write_kv(latent[:, :rank], latent[:, rank:], ckv, kpe)
            self.run(torch.randn(t, self.num_heads, width, dtype=self.dtype, device=dev), ckv, kpe)
        torch.cuda.synchronize(dev)
        self._meta = None
