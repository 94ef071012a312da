"""Decode attention under a CUDA graph: FlashInfer's graph-safe decode wrapper over fixed page-table buffers."""

from __future__ import annotations

import math

import torch

from engine.attention.base import AttentionMetadata
from engine.attention.kv_quant import fp8_scales, write_kv_slots


def use_tensor_core_decode(num_q_heads: int, num_kv_heads: int) -> bool:
    """FlashInfer's advice: the tensor-core (prefill-kernel) decode wins once a KV head serves >= 4 q heads."""
    return num_q_heads // num_kv_heads >= 4


class FlashInferGraphDecode:
    """Decode attention for one captured batch size: a CUDA-graph decode wrapper over fixed buffers.

    plan() runs outside the graph before each replay: it copies the step's page table into the fixed
    buffers (the wrapper's own plan does that) and the KV slots into a fixed slot buffer, so the captured
    kernels read the new step's values at their old addresses.
    """

    def __init__(
        self,
        *,
        workspace: torch.Tensor,
        batch_size: int,
        max_num_indices: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        import flashinfer

        dev, i32 = workspace.device, torch.int32
        self.batch_size = batch_size
        self.shape = (num_q_heads, num_kv_heads, head_dim, dtype)
        self.kv_dtype = kv_dtype or dtype
        self.kv_indptr = torch.zeros(batch_size + 1, dtype=i32, device=dev)
        self.kv_indices = torch.zeros(max_num_indices, dtype=i32, device=dev)
        self.kv_last_page_len = torch.ones(batch_size, dtype=i32, device=dev)
        self.slot_mapping = torch.zeros(batch_size, dtype=torch.int64, device=dev)
        self.source_rows = torch.arange(batch_size, device=dev)  # which row's k/v each slot receives
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            float_workspace_buffer=workspace,
            kv_layout="NHD",
            use_cuda_graph=True,
            use_tensor_cores=use_tensor_core_decode(num_q_heads, num_kv_heads),
            paged_kv_indptr_buffer=self.kv_indptr,
            paged_kv_indices_buffer=self.kv_indices,
            paged_kv_last_page_len_buffer=self.kv_last_page_len,
        )

    def plan(self, meta: AttentionMetadata, source_rows: torch.Tensor | None = None) -> tuple[int, ...]:
        """Plans for `meta` (exactly batch_size rows); returns FlashInfer's plan info (the captured kernel
        arguments depend on it, so a replay is only valid when it equals the one at capture)."""
        num_q_heads, num_kv_heads, head_dim, dtype = self.shape
        self.wrapper.plan(
            indptr=meta.kv_indptr,
            indices=meta.kv_indices,
            last_page_len=meta.kv_last_page_len,
            num_qo_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            page_size=meta.page_size,
            q_data_type=dtype,
            kv_data_type=self.kv_dtype,
            sm_scale=1.0 / math.sqrt(head_dim),
        )
        self.slot_mapping.copy_(meta.slot_mapping, non_blocking=True)
        if source_rows is not None:
            self.source_rows.copy_(source_rows, non_blocking=True)
        return tuple(int(x) for x in self.wrapper._plan_info)

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        # NOTE: padding rows write the real row 0's k/v to row 0's slot (duplicate index, identical value),
        # so whatever a padding row computes never reaches the pool.
        rows = self.source_rows
        write_kv_slots(
            k.index_select(0, rows), v.index_select(0, rows), k_cache, v_cache, self.slot_mapping, k_scale, v_scale
        )

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
            # NOTE: refused rather than dropped: a graph of the plain decode kernel would attend without the sinks.
            raise ValueError("CUDA-graph decode has no sink attention: run a model with sink logits with enforce_eager")
        if q.stride(-1) != 1:
            q = q.contiguous()
        scale_k, scale_v = fp8_scales(k_cache, k_scale, v_scale)
        return self.wrapper.run(q=q, paged_kv_cache=(k_cache, v_cache), k_scale=scale_k, v_scale=scale_v)
