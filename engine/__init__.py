"""The inference engine: continuous batching over a paged KV cache (knows nothing of RunPod or HTTP).

Names are exported lazily, so that `import engine.errors` (the worker's side) does not load torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "AsyncEngine": "engine.core.async_engine",
    "LLMEngine": "engine.core.engine",
    "LLM": "engine.core.llm",
    "FinalOutput": "engine.core.llm",
    "CompletionOutput": "engine.outputs",
    "EngineConfig": "engine.config",
    "SamplingParams": "engine.sample.params",
    "StructuredSpec": "engine.sample.structured.spec",
    "RequestOutput": "engine.outputs",
    "CompletionDelta": "engine.outputs",
    "PositionLogprobs": "engine.outputs",
    "Logprob": "engine.outputs",
    "EngineError": "engine.errors",
    "InvalidRequest": "engine.errors",
    "ContextTooLong": "engine.errors",
    "UnsupportedModel": "engine.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
