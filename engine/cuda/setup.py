"""CUDA start-up: which attention backend, kernel warm-up (JIT), the KV pool budget, the decode graphs' sizes.

The engine calls these in this order on CUDA:
  1. backend = create_backend(resolve_backend(...)[0], device, **backend_kwargs(spec, dtype))
  2. warm_up(model, backend, page_size)          FlashInfer JIT builds happen here, not on a request
  3. kv_budget_bytes(device, utilization, reserve_bytes(...)) -> bytes for the PagePool
  4. prepare_cuda(model, backend, pool.kv_caches, ...) -> the CudaGraphRunner (None when eager), in
     engine/core/cuda_graphs.py: the graphs run the attention backend, which sits above this package
Step 4 needs the pool (graphs read the pool's addresses) and runs the warm-up again, which costs
milliseconds once the kernels are built.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from engine.cuda import kernels
from engine.errors import StartupError

log = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 256  # decode batches up to this size replay a captured graph; larger ones run eagerly
MiB = 1 << 20
# The reserve (reserve_bytes) is memory the KV pool must leave free for what runs after it is sized:
GRAPH_WRAPPER_BYTES = 8 * MiB  # each captured size has its own FlashInfer decode wrapper and int workspace
SAMPLER_BYTES_PER_LOGIT = 32  # fp32 logits, probabilities, log-probabilities, sorted values + int64 order
LOGIT_ROWS_MIN = 256  # prompt_logprobs turns up to 256 prompt rows into logits at once (model_runner)
SLACK_BYTES = 256 * MiB  # cuBLAS workspaces, allocator rounding and fragmentation


def backend_kwargs(spec: Any, dtype: torch.dtype, group: Any = None) -> dict[str, Any]:
    """What FlashInferBackend needs at construction to plan at once and to capture graphs (from a ModelSpec, and
    the KVGroupSpec whose layers the backend serves when given)."""
    kv = group if group is not None else spec
    return dict(num_q_heads=spec.num_q_heads, num_kv_heads=kv.num_kv_heads, head_dim=kv.head_dim, dtype=dtype)


def batch_size_ladder(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_batch_size (which is always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch_size] + list(range(16, max_batch_size, 16))
    return sorted(set(sizes) | {max_batch_size})


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The decode batch sizes captured as CUDA graphs."""
    return batch_size_ladder(min(max_num_seqs, MAX_GRAPH_BATCH))


def reserve_bytes(
    args: Any,
    dtype: torch.dtype,
    *,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_pages_per_seq: int,
    graphs: bool,
) -> int:
    """Memory to keep out of the KV pool, for a LlamaArgs-shaped model (model.args):

    - activations of the largest step (max_num_batched_tokens tokens through one layer at a time: residual,
      hidden, qkv, attention output, o_proj, gate|up, activation, down);
    - the sampler's working set on [rows, vocab] float32 logits (rows: max_num_seqs, or the 256 rows of a
      prompt_logprobs slice);
    - with graphs: a FlashInfer wrapper per captured size, its page-table buffers (int32, up to
      max_pages_per_seq per row) and the graphs' shared pool (activations of the largest size);
    - a hybrid model's decode (args.deltanet, args.mamba): each row's float32 recurrent state gathered and stepped
      into a new one, one layer at a time, eagerly and in the graphs' pool; a Mamba2 prefill's float32 scan per
      token (B and C per head, a chunk's scores and decays, x dt and y: engine.model.layers.ssd.chunked);
    - SLACK_BYTES for cuBLAS workspaces and fragmentation.
    The attention workspace and the weights are not in it: they exist before the budget is measured.
    """
    elt = torch.empty((), dtype=dtype).element_size()
    h, d = args.hidden_size, args.head_dim
    i = getattr(args, "activation_width", args.intermediate_size)  # an MoE's k experts per token
    per_token = elt * (4 * h + 2 * (args.num_q_heads + args.num_kv_heads) * d + 3 * i)
    total = max_num_batched_tokens * per_token
    total += max(max_num_seqs, LOGIT_ROWS_MIN) * args.vocab_size * SAMPLER_BYTES_PER_LOGIT
    if graphs:
        sizes = graph_batch_sizes(max_num_seqs)
        # per row: int32 page indices, indptr and last-page length; int64 slot and source row
        total += len(sizes) * GRAPH_WRAPPER_BYTES + sum(sizes) * (4 * (max_pages_per_seq + 2) + 16)
        total += sizes[-1] * per_token
    shape = getattr(args, "deltanet", None)
    if shape is not None:
        rows = max_num_seqs + (graph_batch_sizes(max_num_seqs)[-1] if graphs else 0)
        total += rows * 2 * 4 * shape.num_v_heads * (shape.head_k_dim + 1) * shape.head_v_dim  # (delta_rule.step_)
    mamba = getattr(args, "mamba", None)
    if mamba is not None:
        rows = max_num_seqs + (graph_batch_sizes(max_num_seqs)[-1] if graphs else 0)
        total += rows * 2 * 4 * mamba.num_heads * mamba.head_dim * mamba.state_size  # (ssd.step_)
        scan = 4 * mamba.num_heads * (2 * mamba.state_size + 2 * mamba.chunk_size + 3 * mamba.head_dim)
        total += max_num_batched_tokens * scan
    return total + SLACK_BYTES


def kv_budget_from(free: int, total: int, gpu_memory_utilization: float, reserve: int) -> int:
    """Bytes for the KV pool: total * utilization, less what is in use now (weights, workspace, CUDA context,
    other processes: total - free), less the reserve. Never negative."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise StartupError(
            f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}", param="gpu_memory_utilization"
        )
    return max(0, int(total * gpu_memory_utilization) - (total - free) - reserve)


def kv_budget_bytes(device: torch.device, gpu_memory_utilization: float, reserve_bytes: int) -> int:
    """kv_budget_from() on the device's free memory now; call after warm_up(), before building the pool."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # the warm-up's freed blocks are free memory, not in use
    free, total = torch.cuda.mem_get_info(device)
    budget = kv_budget_from(free, total, gpu_memory_utilization, reserve_bytes)
    log.info(
        "KV budget %.2f GiB (%.0f%% of %.1f GiB, %.2f GiB in use, %.2f GiB reserved for activations/graphs)",
        budget / 2**30,
        100 * gpu_memory_utilization,
        total / 2**30,
        (total - free) / 2**30,
        reserve_bytes / 2**30,
    )
    return budget


def has_sinks(model: torch.nn.Module) -> bool:
    """Whether any attention layer of the model carries sink logits (gpt-oss)."""
    return any(getattr(m, "sinks", None) is not None for m in model.modules())


def warm_up(model: torch.nn.Module, backend: Any, page_size: int) -> float:
    """Runs the attention backend and the model's fused kernels once, so FlashInfer's JIT builds (or cache
    loads) happen at start-up. Returns the seconds it took."""
    start = time.perf_counter()
    if hasattr(backend, "warmup"):
        if has_sinks(model):  # the sink variant is its own JIT build (gpt-oss)
            backend.warmup(page_size, sinks=True)
        else:
            backend.warmup(page_size)
    if getattr(model, "fused_kernels", False):
        a = model.args
        weight = next(model.parameters())
        kernels.warmup(a.hidden_size, a.intermediate_size, a.head_dim, weight.dtype, weight.device)
    return time.perf_counter() - start
