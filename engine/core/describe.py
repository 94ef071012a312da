"""What LLMEngine.describe() reports: the model, backend, dtype, device, KV cache and limits it started with (the
worker's start-up line and /health read them). Its live load is LLMEngine.stats()."""

from __future__ import annotations

from typing import Any

from engine.model.kv_spec import describe_groups


def describe_engine(e: Any) -> dict:
    """LLMEngine.describe() of the engine `e` (typed Any: engine.core.engine imports this module)."""
    return {
        "model": e.config.model_path,
        "architecture": e.spec.architecture,
        "backend": e.backend_name,
        "backend_reason": e.backend_reason,
        "dtype": str(e.dtype).removeprefix("torch."),
        "dtype_reason": e.dtype_reason,
        "quantization": e.config.quantization,
        "device": str(e.device),
        "tensor_parallel_size": e.config.tensor_parallel_size,
        "threads": e.threads,
        "max_model_len": e.max_model_len,
        "kv_pages": e.allocator.num_pages,
        "kv_groups": describe_groups(e.spec.kv_groups),
        "kv_pages_by_group": [a.num_pages for a in e.kv.allocators],
        "page_size": e.pool.page_size,
        "kv_bytes": sum(p.nbytes for p in e.pools),
        "kv_dtype": str(e.kv_dtype).removeprefix("torch."),
        "max_num_seqs": e.max_num_seqs,
        # A hybrid model's recurrent-state pool: the sequences it holds (as many snapshot slots again), bytes.
        "state_seqs": e.kv.state.num_seqs if e.kv.state is not None else None,
        "state_bytes": e.state_pool.nbytes if e.state_pool is not None else 0,
        "max_num_batched_tokens": e.config.max_num_batched_tokens,
        "prefix_caching": e.config.enable_prefix_caching,
        "adapters": list(e.adapters),
        "speculative": e.speculator.describe() if e.speculator is not None else None,
    }
