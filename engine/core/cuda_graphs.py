"""Decode steps under CUDA graphs: one graph per batch size of a ladder, replayed over static buffers.

A decode batch of b rows is padded to the smallest captured size >= b. Padding rows run token 0 at
position 0 against one written slot of row 0's page and write nothing of their own (FlashInferGraphDecode
routes row 0's K/V to their slot), so their results are simply dropped. Steps with prefill and batches
above the largest size run eagerly. prepare_cuda() is start-up's last CUDA step: warm-up, then the capture.

A hybrid model's recurrent layers (Gated DeltaNet) read and write the state pool through one more static buffer,
each row's slot (RecurrentStep.graphed); padding rows point at the pool's scratch slot, which nothing else reads.
A decode step's snapshots (the state after the step, for the prefix cache) are copied after the replay, outside
the graph, so that steps with snapshots replay too.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention.base import AttentionMetadata
from engine.attention.flashinfer import FlashInferBackend
from engine.attention.flashinfer_graph import FlashInferGraphDecode
from engine.core.kv.state_cache import StatePool
from engine.cuda.setup import graph_batch_sizes, warm_up
from engine.model.capture import capture_blocker
from engine.model.kv_spec import KVGroupSpec, graphs_blocker
from engine.model.layers.recurrent_step import RecurrentPlan, RecurrentStep

log = logging.getLogger(__name__)

# model(input_ids, positions, meta, kv_caches, backend) -> hidden [tokens, hidden_size], as CausalLM.forward
ModelForward = Callable[..., torch.Tensor]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    attention: FlashInferGraphDecode
    output: torch.Tensor  # [batch_size, hidden], overwritten by every replay
    plan_info: tuple[int, ...]  # FlashInfer's plan at capture; replays must plan the same


class CudaGraphRunner:
    """Runs one model step: decode batches by CUDA graph replay, everything else eagerly through `backend`.

    capture() must run before any request holds KV pages: capturing writes scratch K/V into page 0.
    kv_caches and layer_backends are what the model takes: one KV group's caches and `backend` alone, or (a hybrid
    model, with its state_pool) per layer, `backend` at attention layers and a RecurrentPlan at recurrent ones.
    """

    def __init__(
        self,
        *,
        model: ModelForward,
        backend: FlashInferBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        batch_sizes: Sequence[int],
        max_pages_per_seq: int,
        layer_backends: list[Any] | None = None,
        state_pool: StatePool | None = None,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.layer_backends = layer_backends
        self.state_pool = state_pool
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_pages_per_seq = max_pages_per_seq
        pages = (
            kv_caches
            if layer_backends is None
            else [c for c, b in zip(kv_caches, layer_backends, strict=True) if b is backend]
        )
        self.page_size = pages[0][0].shape[1]
        dev = backend.device
        max_bs = self.batch_sizes[-1] if self.batch_sizes else 0
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.long, device=dev)
        scratch = state_pool.scratch if state_pool is not None else 0
        self.state_slots = torch.full((max_bs,), scratch, dtype=torch.long, device=dev)  # static: each row's slot
        self.graphs: dict[int, _Graph] = {}
        self.replays = 0
        self.eager_fallbacks = 0  # decode steps that could not replay (plan changed): should stay 0

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every batch size, largest first, all sharing one memory pool."""
        pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize(self.backend.device)
        for bs in reversed(self.batch_sizes):
            attention = self.backend.graph_decode(bs, bs * self.max_pages_per_seq)
            meta = self._dummy_meta(bs)
            plan_info = attention.plan(meta)
            ids, pos = self.input_ids[:bs], self.positions[:bs]
            backends = self._graph_backends(attention, bs)
            for _ in range(2):  # warm-up outside the graph: lazy buffers, cuBLAS handles, autotuning, Triton builds
                self.model(ids, pos, meta, self.kv_caches, backends)
            torch.cuda.synchronize(self.backend.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                output = self.model(ids, pos, meta, self.kv_caches, backends)
            self.graphs[bs] = _Graph(graph, attention, output, plan_info)
        torch.cuda.synchronize(self.backend.device)
        log.info("captured CUDA graphs for decode batch sizes %s", self.batch_sizes)

    def _graph_backends(self, attention: FlashInferGraphDecode, bs: int) -> Any:
        """The model's backend argument in the graph of size bs: the graph's attention for `backend`, and for the
        recurrent layers a plan over the static slots (all the scratch slot until a replay fills them)."""
        if self.layer_backends is None:
            return attention
        plan = RecurrentPlan()
        plan.plan(RecurrentStep.graphed(self.state_slots[:bs]))
        return [
            attention if b is self.backend else plan if isinstance(b, RecurrentPlan) else b for b in self.layer_backends
        ]

    def _dummy_meta(self, bs: int) -> AttentionMetadata:
        dev, i32 = self.backend.device, torch.int32
        return AttentionMetadata(
            qo_indptr=torch.arange(bs + 1, dtype=i32, device=dev),
            kv_indptr=torch.arange(bs + 1, dtype=i32, device=dev),
            kv_indices=torch.zeros(bs, dtype=i32, device=dev),
            kv_last_page_len=torch.ones(bs, dtype=i32, device=dev),
            slot_mapping=torch.zeros(bs, dtype=torch.long, device=dev),
            page_size=self.page_size,
            is_decode=True,
        )

    def graph_size(self, meta: AttentionMetadata, num_tokens: int) -> int | None:
        """The captured batch size this step would replay at, or None when it runs eagerly."""
        if not meta.is_decode or not self.graphs:
            return None
        i = bisect_left(self.batch_sizes, num_tokens)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        recurrent: RecurrentStep | None = None,
    ) -> torch.Tensor:
        """hidden [tokens, hidden_size] for the step. A replayed result is a view of a static buffer that
        the next replay overwrites: use it (compute logits) before the next call. recurrent: a hybrid model's step
        plan, the one its layer_backends' RecurrentPlan holds."""
        b = input_ids.shape[0]
        bs = self.graph_size(meta, b)
        if bs is not None:
            g = self.graphs[bs]
            if g.attention.plan(*_pad_meta(meta, bs)) == g.plan_info:
                self.input_ids[:b].copy_(input_ids)
                self.positions[:b].copy_(positions)
                self.input_ids[b:bs].fill_(0)
                self.positions[b:bs].fill_(0)
                if recurrent is not None:
                    assert self.state_pool is not None, "a hybrid model's graphs hold its state pool"
                    self.state_slots[:b].copy_(recurrent.slot_index)
                    self.state_slots[b:bs].fill_(self.state_pool.scratch)
                g.graph.replay()
                self.replays += 1
                if recurrent is not None and recurrent.captures:
                    assert self.state_pool is not None
                    self.state_pool.copy_slots([(recurrent.slots[i], dst) for i, _, dst in recurrent.captures])
                return g.output[:b]
            self.eager_fallbacks += 1
            log.warning("FlashInfer plan for batch %d differs from its capture; running eagerly", bs)
        self.backend.plan(meta)
        return self.model(input_ids, positions, meta, self.kv_caches, self.layer_backends or self.backend)


def graphs_off_because(
    model: torch.nn.Module,
    groups: list[KVGroupSpec],
    device: torch.device,
    dtype: torch.dtype,
    *,
    lora: bool,
    head: bool,
    ranks: bool,
) -> str | None:
    """Why decode must run without CUDA graphs, or None. lora: a step's adapter grouping is Python control flow
    that a replayed graph would freeze; head: an EAGLE-3 or MTP head reads hidden states the graph does not keep;
    ranks: tensor parallelism's collectives run outside any graph; an encoder never decodes."""
    return (
        ("an encoder, which never decodes" if getattr(model, "encoder", False) else None)
        or graphs_blocker(groups)
        or capture_blocker(model, device, dtype)
        or ("LoRA adapters" if lora else None)
        or ("a hidden-state head (EAGLE-3, MTP)" if head else None)
        or ("tensor parallelism" if ranks else None)
    )


def prepare_cuda(
    model: torch.nn.Module,
    backend: Any,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    page_size: int,
    max_num_seqs: int,
    max_model_len: int,
    enforce_eager: bool,
    why: str | None = None,
    layer_backends: list[Any] | None = None,
    state_pool: StatePool | None = None,
) -> CudaGraphRunner | None:
    """Warms the kernels up and, unless enforce_eager (or the backend cannot run under graphs), captures decode
    CUDA graphs at graph_batch_sizes(max_num_seqs). Call before any request holds KV pages. why: the reason
    enforce_eager was set, for the start-up log; layer_backends, state_pool: a hybrid model's (CudaGraphRunner)."""
    seconds = warm_up(model, backend, page_size)
    log.info("kernel warm-up took %.1f s", seconds)
    if enforce_eager or not hasattr(backend, "graph_decode"):
        log.info("decode runs eagerly (%s)", why or ("enforce_eager" if enforce_eager else type(backend).__name__))
        return None
    start = time.perf_counter()
    runner = CudaGraphRunner(
        model=model,
        backend=backend,
        kv_caches=kv_caches,
        batch_sizes=graph_batch_sizes(max_num_seqs),
        max_pages_per_seq=-(-max_model_len // page_size),
        layer_backends=layer_backends,
        state_pool=state_pool,
    )
    runner.capture()
    log.info(
        "captured decode CUDA graphs for batch sizes %s in %.1f s", runner.batch_sizes, time.perf_counter() - start
    )
    return runner


def _pad_meta(meta: AttentionMetadata, bs: int) -> tuple[AttentionMetadata, torch.Tensor]:
    """Decode metadata of b rows grown to bs rows, plus the source row of each row's K/V write."""
    b = meta.kv_last_page_len.shape[0]
    dev = meta.kv_indptr.device
    pad = bs - b
    rows = torch.arange(bs, device=dev)
    if pad == 0:
        return meta, rows
    i32 = torch.int32
    ones = torch.ones(pad, dtype=i32, device=dev)
    row0_slot = meta.slot_mapping[:1]
    row0_page = (row0_slot // meta.page_size).to(i32)
    rows[b:] = 0
    padded = AttentionMetadata(
        qo_indptr=torch.arange(bs + 1, dtype=i32, device=dev),
        kv_indptr=torch.cat([meta.kv_indptr, meta.kv_indptr[-1:] + torch.cumsum(ones, 0, dtype=i32)]),
        kv_indices=torch.cat([meta.kv_indices, row0_page.expand(pad)]),
        kv_last_page_len=torch.cat([meta.kv_last_page_len, ones]),
        slot_mapping=torch.cat([meta.slot_mapping, row0_slot.expand(pad)]),
        page_size=meta.page_size,
        is_decode=True,
    )
    return padded, rows
