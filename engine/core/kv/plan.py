"""How many KV pages each layer group gets, and how many sequences a hybrid model's state pool holds, from the
settings, the device and the model: the start-up decision engine/core/engine.py builds the caches from.

The pages and the recurrent state come out of one byte budget (KV_CACHE_BYTES, the GPU's free memory under
gpu_memory_utilization, or the CPU default); the state pool takes its slots first (at most half the budget,
engine/core/kv/state_cache.py), the pages the rest.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.core.kv import sizing as kv_sizing
from engine.core.kv.state_cache import EXTRA_SLOTS, state_slots_for_budget
from engine.cuda import setup as cuda_setup
from engine.errors import StartupError
from engine.model.kv_spec import graphs_blocker
from engine.model.quant.mxfp4_packed import scratch_bytes as mxfp4_scratch_bytes

log = logging.getLogger(__name__)

# CPU default pool: room for max_num_seqs requests of this many tokens, but at most CPU_KV_BYTES.
CPU_CONTEXT_PER_SEQ = 2048
CPU_KV_BYTES = 1 << 30


@dataclass
class CachePlan:
    num_pages: list[int]  # per KV layer group
    max_model_len: int  # lowered to what the pages hold when the user did not set it
    state_seqs: int | None  # sequences the recurrent-state pool holds (None: no recurrent layers)
    state_bytes: int = 0


def plan_cache(
    config: EngineConfig,
    spec,
    model: torch.nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    max_model_len: int,
) -> CachePlan:
    c, ps, groups = config, config.page_size, spec.kv_groups
    caps = kv_sizing.window_caps(groups, ps, c.max_num_seqs, c.max_num_batched_tokens)
    sizes = kv_sizing.page_bytes(groups, ps, kv_dtype)
    full_seq = kv_sizing.pages_for_one_sequence(caps, groups, ps, max_model_len, c.max_num_batched_tokens)
    if c.kv_cache_bytes:
        budget = c.kv_cache_bytes
    elif device.type == "cuda":
        reserve = cuda_setup.reserve_bytes(
            model.args,
            dtype,
            max_num_batched_tokens=c.max_num_batched_tokens,
            max_num_seqs=c.max_num_seqs,
            max_pages_per_seq=full_seq,
            graphs=not c.enforce_eager and graphs_blocker(groups) is None,
        )
        reserve += mxfp4_scratch_bytes(model)  # allocated by the first step, after this is measured
        budget = cuda_setup.kv_budget_bytes(device, c.gpu_memory_utilization, reserve)
    else:
        budget = CPU_KV_BYTES
    state_seqs, state_bytes = None, 0
    if spec.recurrent is not None:
        state_seqs = (
            c.max_num_seqs if c.num_kv_pages else state_slots_for_budget(spec.recurrent, dtype, budget, c.max_num_seqs)
        )
        state_bytes = (2 * state_seqs + EXTRA_SLOTS) * spec.recurrent.slot_bytes(dtype)
    fit = kv_sizing.pages_for_budget(max(0, budget - state_bytes), sizes, caps)
    if c.num_kv_pages:
        pages = c.num_kv_pages
    elif c.kv_cache_bytes or device.type == "cuda":
        pages = fit
    else:
        want = c.max_num_seqs * min(max_model_len, CPU_CONTEXT_PER_SEQ)
        pages = max(full_seq, min(-(-want // ps), fit))
    if pages < full_seq:
        if c.max_model_len:
            more = (
                "num_kv_pages" if c.num_kv_pages else "kv_cache_bytes" if c.kv_cache_bytes else "gpu_memory_utilization"
            )
            raise StartupError(
                f"the KV cache ({pages} pages of {ps} tokens) cannot hold one sequence of "
                f"max_model_len={max_model_len} tokens: lower max_model_len to at most "
                f"{pages * ps}, or raise {more}",
                param="max_model_len",
            )
        log.warning("max_model_len lowered to %d tokens to fit the KV cache", pages * ps)
        max_model_len = pages * ps
    return CachePlan(kv_sizing.group_pages(caps, pages), max_model_len, state_seqs, state_bytes)
