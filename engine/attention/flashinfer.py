"""FlashInfer attention on CUDA: paged prefill/decode wrappers over the NHD pool, planned once per step.

Pinned to flashinfer-python 0.5.3 (see requirements-cuda.txt); the package is imported lazily so that this
module imports on machines without CUDA or FlashInfer. Kernels are JIT-compiled on first use and cached
under ~/.cache/flashinfer (FLASHINFER_WORKSPACE_BASE moves it); warmup() triggers that at start-up.

Sink logits (gpt-oss) go through FlashInfer's attention-sink variant of the FA2 paged prefill kernel (any GPU FA2
runs on), which serves prefill and decode steps alike, built as BatchAttentionWithAttentionSinkWrapper builds it but
under a module name that holds the head size and KV dtype (engine.cuda.kernels.sink_module_args); 0.5.3's `sinks`
argument on the plain wrappers reaches only the trtllm-gen kernels (Blackwell), so it is not used.

Every call into FlashInfer passes its arguments by keyword (tests/engine/cuda/test_library_calls.py binds each to
the installed release's signature); positions are used only before a `*args` the call fills.

A prefill step with image tokens that attend to each other both ways (AttentionMetadata.bidirectional, Gemma 3)
plans the prefill wrapper with a custom mask (engine/attention/masks.py, the torch backend's), the sliding window
folded into it.

An FP8 KV cache is FlashInfer's own: plan() with kv_data_type float8_e4m3fn, run() with the layer's k_scale and
v_scale, which FlashInfer folds into sm_scale and the output (the sink variant takes no scales: the same folding
is done here).
"""

from __future__ import annotations

import math

import torch

from engine.attention.base import AttentionMetadata, warmup_steps
from engine.attention.flashinfer_graph import FlashInferGraphDecode, use_tensor_core_decode
from engine.attention.kv_quant import fp8_scales, is_fp8, write_kv_slots
from engine.attention.masks import prefill_mask
from engine.cuda.kernels import DEFAULT_PREFILL_BACKEND, sink_module_args

# The float workspace (split-KV partial results), shared by every wrapper.
# NOTE: not FlashInfer's example 128 MiB: under CUDA graphs the tensor-core decode always splits the KV and
# sizes its partials for the worst case, num_q_heads x (batch * group / 16 + batch - 1) tiles x 16 rows x
# head_dim x 4 bytes: 193 MiB for 64 query heads of 128 at batch 256 (a 32B-70B model), which overflows at
# capture. vLLM's default is 394 MiB.
WORKSPACE_BYTES = 384 * 1024 * 1024
HALF_DTYPES = (torch.float16, torch.bfloat16)


class FlashInferBackend:
    """AttentionBackend on FlashInfer: BatchPrefillWithPagedKVCacheWrapper for steps with any prefill,
    BatchDecodeWithPagedKVCacheWrapper for pure decode steps, one shared workspace (WORKSPACE_BYTES).

    The head counts and dtype are taken from the constructor when given (plan() then plans at once), else
    from the first run() of a step (which plans then; later layers reuse it).
    """

    name = "flashinfer"

    def __init__(
        self,
        *,
        device: torch.device | str = "cuda",
        num_q_heads: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        dtype: torch.dtype | None = None,
        kv_dtype: torch.dtype | None = None,
        workspace_bytes: int = WORKSPACE_BYTES,
        prefill_backend: str = DEFAULT_PREFILL_BACKEND,
        window: int | None = None,
        scale: float | None = None,
        soft_cap: float | None = None,
        **_: object,
    ) -> None:
        import flashinfer

        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"FlashInfer attention needs a CUDA device, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if dtype is not None and dtype not in HALF_DTYPES:
            raise ValueError(f"FlashInfer attention needs float16 or bfloat16, got {dtype} (use the torch backend)")
        self.shape = (num_q_heads, num_kv_heads, head_dim, dtype)
        self.kv_dtype = kv_dtype or dtype  # the pages' dtype: the model's, or float8_e4m3fn
        # A sliding window of W tokens is FlashInfer's window_left = W - 1 (keys i - W + 1 .. i); -1: no window,
        # plan()'s default, so a full-attention model plans exactly as before.
        self.window_left = -1 if window is None else window - 1
        # Attention extras of the group's layers (Gemma): FlashInfer's sm_scale and logits_soft_cap on plan().
        self.scale = scale
        self.soft_cap = soft_cap
        # Zeroed: FlashInfer asks for a zero-initialised float workspace before its first use.
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            float_workspace_buffer=self.workspace, kv_layout="NHD", backend=prefill_backend
        )
        self._decode: dict[bool, object] = {}  # by use_tensor_cores; one is ever used per model
        self._prefill_backend = prefill_backend
        self._sink_wrapper: object | None = None  # built by the first run() with sinks
        self._meta: AttentionMetadata | None = None
        self._active: object | None = None  # the wrapper planned for the current step
        self._sink_planned = False  # whether _sink_wrapper is planned for the current step

    def plan(self, meta: AttentionMetadata) -> None:
        self._meta = meta
        self._active = None
        self._sink_planned = False
        if None not in self.shape:
            self._plan(*self.shape, kv_dtype=self.kv_dtype)

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        assert self._meta is not None, "plan() was not called for this step"
        write_kv_slots(k, v, k_cache, v_cache, self._meta.slot_mapping, k_scale, v_scale)

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        sinks: torch.Tensor | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        if q.stride(-1) != 1:
            q = q.contiguous()
        if sinks is not None:
            return self._run_with_sinks(q, k_cache, v_cache, sinks, k_scale, v_scale)
        if self._active is None:
            self._plan(q.shape[1], k_cache.shape[2], q.shape[2], q.dtype, kv_dtype=k_cache.dtype)
        scale_k, scale_v = fp8_scales(k_cache, k_scale, v_scale)
        return self._active.run(q=q, paged_kv_cache=(k_cache, v_cache), k_scale=scale_k, v_scale=scale_v)

    def _run_with_sinks(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        sinks: torch.Tensor,
        k_scale: float,
        v_scale: float,
    ) -> torch.Tensor:
        meta = self._meta
        assert meta is not None, "plan() was not called for this step"
        num_q_heads, head_dim = q.shape[1], q.shape[2]
        if q.dtype not in HALF_DTYPES:
            raise ValueError(f"FlashInfer attention needs float16 or bfloat16, got {q.dtype} (use the torch backend)")
        if self.soft_cap is not None:
            raise ValueError("attention sinks with a logit soft-cap are not implemented")
        scale = 1.0 / math.sqrt(head_dim) if self.scale is None else self.scale
        if self._sink_wrapper is None:
            import flashinfer

            jit_args, jit_kwargs = sink_module_args(
                backend=self._prefill_backend,
                q_dtype=q.dtype,
                kv_dtype=k_cache.dtype,
                head_dim=head_dim,
                sliding_window=self.window_left >= 0,
            )
            self._sink_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                float_workspace_buffer=self.workspace,
                kv_layout="NHD",
                backend=self._prefill_backend,
                jit_args=jit_args,
                jit_kwargs=jit_kwargs,
            )
        if not self._sink_planned:
            # Decode steps too: a decode row is a prefill of one query token (causal from the KV's end).
            self._sink_wrapper.plan(
                qo_indptr=meta.qo_indptr,
                paged_kv_indptr=meta.kv_indptr,
                paged_kv_indices=meta.kv_indices,
                paged_kv_last_page_len=meta.kv_last_page_len,
                num_qo_heads=num_q_heads,
                num_kv_heads=k_cache.shape[2],
                head_dim_qk=head_dim,
                page_size=meta.page_size,
                causal=True,
                q_data_type=q.dtype,
                kv_data_type=k_cache.dtype,
                sm_scale=scale,
                window_left=self.window_left,
            )
            self._sink_planned = True
        # NOTE: the variant reads its own sm_scale argument, not the planned one; sinks are float32 per q head.
        # Both travel through run()'s *args, in the variant's declared order (sink, then sm_scale).
        # FP8 pages: K's scale folds into sm_scale and V's into the output (the sink key has no value).
        fp8 = is_fp8(k_cache)
        out = self._sink_wrapper.run(q, (k_cache, v_cache), sinks.float(), scale * (k_scale if fp8 else 1.0))
        return out * v_scale if fp8 and v_scale != 1.0 else out

    def _plan(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        if dtype not in HALF_DTYPES:
            raise ValueError(f"FlashInfer attention needs float16 or bfloat16, got {dtype} (use the torch backend)")
        meta = self._meta
        assert meta is not None, "plan() was not called for this step"
        scale = 1.0 / math.sqrt(head_dim) if self.scale is None else self.scale
        kv_dtype = kv_dtype or dtype
        if meta.is_decode:
            decode = self._decode_wrapper(use_tensor_core_decode(num_q_heads, num_kv_heads))
            decode.plan(
                indptr=meta.kv_indptr,
                indices=meta.kv_indices,
                last_page_len=meta.kv_last_page_len,
                num_qo_heads=num_q_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                page_size=meta.page_size,
                q_data_type=dtype,
                kv_data_type=kv_dtype,
                sm_scale=scale,
                window_left=self.window_left,
                logits_soft_cap=self.soft_cap,
            )
            self._active = decode
            return
        # An image's tokens see each other both ways (bidirectional): a custom mask with the window folded in, so
        # no window_left; else causal, which FlashInfer aligns to the end of the KV (the query offset).
        bidirectional = bool(meta.bidirectional)
        self._prefill.plan(
            qo_indptr=meta.qo_indptr,
            paged_kv_indptr=meta.kv_indptr,
            paged_kv_indices=meta.kv_indices,
            paged_kv_last_page_len=meta.kv_last_page_len,
            num_qo_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim_qk=head_dim,
            page_size=meta.page_size,
            custom_mask=self._custom_mask(meta) if bidirectional else None,
            causal=not bidirectional,
            q_data_type=dtype,
            kv_data_type=kv_dtype,
            sm_scale=scale,
            window_left=-1 if bidirectional else self.window_left,
            logits_soft_cap=self.soft_cap,
        )
        self._active = self._prefill

    def _custom_mask(self, meta: AttentionMetadata) -> torch.Tensor:
        """Every request's [q_len, kv_len] mask (engine.attention.masks), flattened and concatenated, as
        FlashInfer's plan(custom_mask=...) takes it."""
        qo, kv, last = meta.qo_indptr.tolist(), meta.kv_indptr.tolist(), meta.kv_last_page_len.tolist()
        window = None if self.window_left < 0 else self.window_left + 1
        masks = []
        for i in range(len(qo) - 1):
            q_len, kv_len = qo[i + 1] - qo[i], (kv[i + 1] - kv[i] - 1) * meta.page_size + last[i]
            masks.append(prefill_mask(q_len, kv_len, 0, window, meta.bidirectional[i], self.device).flatten())
        return torch.cat(masks)

    def _decode_wrapper(self, tensor_cores: bool) -> object:
        if tensor_cores not in self._decode:
            import flashinfer

            self._decode[tensor_cores] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                float_workspace_buffer=self.workspace, kv_layout="NHD", use_tensor_cores=tensor_cores
            )
        return self._decode[tensor_cores]

    def graph_decode(self, batch_size: int, max_num_indices: int) -> FlashInferGraphDecode:
        """An attention object for decode steps of exactly `batch_size` rows under a CUDA graph."""
        num_q_heads, num_kv_heads, head_dim, dtype = self.shape
        if None in self.shape:
            raise ValueError("graph_decode() needs num_q_heads, num_kv_heads, head_dim and dtype at construction")
        return FlashInferGraphDecode(
            workspace=self.workspace,
            batch_size=batch_size,
            max_num_indices=max_num_indices,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            kv_dtype=self.kv_dtype,
        )

    def warmup(self, page_size: int, sinks: bool = False) -> None:
        """Runs one tiny prefill and one decode on scratch pages, so the JIT builds happen now, not on a request;
        sinks: the sink variant's too (for a model whose layers carry sink logits)."""
        num_q_heads, num_kv_heads, head_dim, dtype = self.shape
        if None in self.shape:
            raise ValueError("warmup() needs num_q_heads, num_kv_heads, head_dim and dtype at construction")
        dev = self.device
        cache = torch.zeros(2, 2, page_size, num_kv_heads, head_dim, dtype=self.kv_dtype, device=dev)
        k_cache, v_cache = cache[0], cache[1]
        prefill, decode = warmup_steps(page_size, dev)
        for meta in (prefill, decode):
            t = meta.slot_mapping.numel()
            q = torch.randn(t, num_q_heads, head_dim, dtype=dtype, device=dev)
            kv = torch.randn(t, num_kv_heads, head_dim, dtype=dtype, device=dev)
            self.plan(meta)
            self.write_kv(kv, kv, k_cache, v_cache)
            self.run(q, k_cache, v_cache)
            if sinks:
                self.run(q, k_cache, v_cache, sinks=torch.zeros(num_q_heads, device=dev))
        torch.cuda.synchronize(dev)
        self._meta = self._active = None
        self._sink_planned = False
