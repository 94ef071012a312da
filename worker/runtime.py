"""The engine singleton and what every request needs next to it (settings, served names, start time).

The engine import happens here, inside `start`, so importing `worker` stays free of torch.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from worker.concurrency import ConcurrencyGauge
from worker.lora_sources import startup_adapters
from worker.metrics import Metrics
from worker.model_cache import locate_model
from worker.openai.errors import StoreUnavailable
from worker.openai.harmony.encoding import harmony_encoding
from worker.openai.reasoning import pick_reasoning
from worker.openai.responses.redis_store import RedisResponseStore
from worker.openai.responses.store import ResponseStore
from worker.openai.tools.registry import model_type, pick_format, template_text
from worker.settings import Settings, accepted_model_names, baked_adapters
from worker.shutdown import Drain
from worker.speculative_source import locate_speculative

log = logging.getLogger("worker")


@dataclass(kw_only=True)
class Runtime:
    """The running engine plus the worker's view of it."""

    settings: Settings
    engine: Any  # engine.core.async_engine.AsyncEngine (not imported at module level: it brings torch)
    model_names: list[str]  # accepted request names; the first is the one responses carry
    created: int  # unix time the model was loaded, reported by /v1/models
    responses: ResponseStore | RedisResponseStore  # stored Responses API responses
    drain: Drain  # SIGTERM's grace period
    metrics: Metrics | None = None  # what /metrics serves (None: a runtime built without them, in tests)

    @property
    def served_model_name(self) -> str:
        return self.model_names[0]

    @property
    def adapters(self) -> list[str]:
        """The names of the LoRA adapters the engine serves now (loaded at start-up or since)."""
        return self.engine.adapters

    @cached_property
    def concurrency(self) -> ConcurrencyGauge:
        """How many jobs the worker takes at once, from the engine's free KV pages, within MAX_CONCURRENCY."""
        info = self.engine.describe()
        return ConcurrencyGauge(
            self.engine.stats, info["kv_pages"], info["max_num_seqs"], self.settings.max_concurrency
        )

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @cached_property
    def tool_format(self) -> str:
        """The tool-call format of the served chat template (TOOL_CALL_PARSER, else read from it and the family)."""
        return self.formats_for(None)[0]

    @cached_property
    def reasoning_format(self) -> str | None:
        """The reasoning parser of the served chat template (REASONING_PARSER, else read from it); None: none."""
        return self.formats_for(None)[1]

    @cached_property
    def harmony(self) -> Any:
        """openai-harmony's encoding for a gpt-oss model (StartupError in one line when its o200k file is missing)."""
        return harmony_encoding(self.settings.model_path)

    def template_for(self, chat_template: str | None) -> str:
        """The chat template text a request renders with: its own, else CUSTOM_CHAT_TEMPLATE, else the model's."""
        return (
            chat_template
            or self.settings.custom_chat_template
            or template_text(getattr(self.tokenizer, "chat_template", None))
        )

    def formats_for(self, chat_template: str | None) -> tuple[str, str | None]:
        """(tool-call format, reasoning parser) for a request's own chat template (None: the served one)."""
        text = self.template_for(chat_template)
        tools = pick_format(text, model_type(self.settings.model_path), self.settings.tool_call_parser)
        return tools, "harmony" if tools == "harmony" else pick_reasoning(text, self.settings.reasoning_parser)


_current: Runtime | None = None


def start(settings: Settings) -> Runtime:
    """Build the engine once over the model `locate_model` finds (later calls return the same runtime) and log one
    line describing it."""
    global _current
    if _current is not None:
        return _current
    from engine.config import EngineConfig, LoraConfig
    from engine.core.async_engine import AsyncEngine
    from engine.errors import StartupError
    from engine.sample.structured.spec import JSON_MAX_WHITESPACE

    settings = locate_model(settings)
    config = EngineConfig(
        model_path=settings.model_path,
        dtype=settings.dtype,
        quantization=None if settings.quantization == "none" else settings.quantization,
        device=settings.device,
        attention_backend=settings.attention_backend,
        max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        page_size=settings.block_size,
        num_kv_pages=settings.num_gpu_blocks_override,
        kv_cache_dtype=settings.kv_cache_dtype,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        enable_prefix_caching=settings.enable_prefix_caching,
        scheduling_policy=settings.scheduling_policy,
        enforce_eager=settings.enforce_eager,
        seed=settings.seed,
        structured_max_whitespace=None if settings.structured_output_free_whitespace else JSON_MAX_WHITESPACE,
        cpu_threads=settings.omp_num_threads,
        lora=LoraConfig(
            startup_adapters(settings, baked_adapters(settings)),
            settings.max_loras,
            settings.max_lora_rank,
            runtime=settings.enable_lora and settings.allow_runtime_lora_updating,
        ),
        speculative=speculative_config(settings),
        tensor_parallel_size=(
            settings.tensor_parallel_size
            if settings.tensor_parallel_size == "auto"
            else int(settings.tensor_parallel_size)
        ),
        tensor_parallel_timeout_s=settings.tensor_parallel_timeout_s,
    )
    model_names = accepted_model_names(settings)
    metrics = Metrics(model_names[0])
    try:
        engine = AsyncEngine(config, on_fatal=exit_on_fatal, observer=metrics)
    except StartupError as exc:
        raise StartupError(_as_env_names(exc.message), param=exc.param) from None
    metrics.watch(engine.stats, engine.describe()["kv_pages"])
    store = response_store(settings)
    runtime = Runtime(
        settings=settings,
        engine=engine,
        model_names=model_names,
        created=int(time.time()),
        responses=store,
        drain=Drain(engine, settings.shutdown_grace_s),
        metrics=metrics,
    )
    if runtime.tool_format == "harmony":
        runtime.harmony  # noqa: B018 -- loaded now, so a missing vocabulary fails the start, not a request
    _current = runtime
    log.info("serving %s", describe(_current))
    return _current


# After a fatal engine error, how long the failed requests' error responses get to leave before the worker exits.
FATAL_EXIT_DELAY_S = 2.0


def exit_on_fatal(error: Any) -> None:
    """The engine died (a tensor-parallel rank failed): its requests got the error; the worker exits non-zero soon
    after, so that RunPod replaces it instead of sending it jobs it cannot run."""
    log.critical("the engine stopped (%s): the worker exits in %.0f s", error, FATAL_EXIT_DELAY_S)
    threading.Timer(FATAL_EXIT_DELAY_S, os._exit, args=(1,)).start()


def speculative_config(settings: Settings) -> Any:
    """SPECULATIVE_CONFIG as the engine's SpeculativeConfig (None when unset), its draft or head folder found by
    worker/speculative_source.py."""
    from engine.config import SpeculativeConfig

    spec = settings.speculative
    if spec is None:
        return None
    model = None if spec.model is None else locate_speculative(spec.model, settings)
    return SpeculativeConfig(
        method=spec.method,
        num_speculative_tokens=spec.num_speculative_tokens,
        prompt_lookup_min=spec.lookup[0],
        prompt_lookup_max=spec.lookup[1],
        model=model,
        disable_by_batch_size=spec.disable_by_batch_size,
    )


# The engine names its settings as EngineConfig does; a worker's user sets them as these variables.
ENV_OF_ENGINE_SETTING = {
    "max_model_len": "MAX_MODEL_LEN",
    "num_kv_pages": "NUM_GPU_BLOCKS_OVERRIDE",
    "gpu_memory_utilization": "GPU_MEMORY_UTILIZATION",
    "attention_backend": "ATTENTION_BACKEND",
    "dtype": "DTYPE",
    "max_num_seqs": "MAX_NUM_SEQS",
    "page_size": "BLOCK_SIZE",
    "kv_cache_dtype": "KV_CACHE_DTYPE",
    "tensor_parallel_size": "TENSOR_PARALLEL_SIZE",
}


def response_store(settings: Settings) -> ResponseStore | RedisResponseStore:
    """The Responses API's store: this process's memory, or the Redis server RESPONSE_STORE_URL names, which every
    worker of an endpoint shares (down at start: said, and only requests that store or continue fail)."""
    max_bytes = int(settings.response_store_max_mb * 2**20)
    if not settings.response_store_url:
        return ResponseStore(settings.response_store_max_entries, max_bytes)
    store = RedisResponseStore(
        url=settings.response_store_url,
        max_entries=settings.response_store_max_entries,
        max_bytes=max_bytes,
        ttl_s=settings.response_store_ttl_s,
    )
    try:
        store.check()
        log.info("responses stored in Redis at %s (TTL %d s)", store.where, settings.response_store_ttl_s)
    except StoreUnavailable as exc:
        log.warning("%s", exc.message)
    return store


def _as_env_names(message: str) -> str:
    return re.sub(r"\b(" + "|".join(ENV_OF_ENGINE_SETTING) + r")\b", lambda m: ENV_OF_ENGINE_SETTING[m[1]], message)


def current() -> Runtime:
    """The runtime `start` built; a RuntimeError before that."""
    if _current is None:
        raise RuntimeError("the engine has not been started (worker.runtime.start)")
    return _current


def engine_stats(runtime: Runtime) -> dict[str, Any]:
    """describe() plus the live load (free KV pages, cached prefix pages included) for /health."""
    return {**runtime.engine.describe(), **runtime.engine.stats()}


def describe(runtime: Runtime) -> str:
    """One line: model, served name, backend, dtype and KV pool size (the keys LLMEngine.describe gives)."""
    info = dict(runtime.engine.describe())
    quantization = f" quantization={info['quantization']}" if info.get("quantization") else ""
    threads = f" threads={info['threads']}" if info.get("threads") else ""
    return (
        f"model={info['model']} served_as={runtime.served_model_name} "
        f"backend={info['backend']} ({info['backend_reason']}) dtype={info['dtype']} ({info['dtype_reason']})"
        f"{quantization} device={info['device']}{threads} "
        + (f"tensor_parallel={info['tensor_parallel_size']} " if info.get("tensor_parallel_size", 1) > 1 else "")
        + f"kv_pages={info['kv_pages']}x{info['page_size']} ({info['kv_pages'] * info['page_size']} tokens, "
        f"{info['kv_dtype']}, {info['kv_bytes'] / 2**20:.0f} MiB) "
        f"kv_groups={info['kv_groups']} "
        + (
            f"state_pool={info['state_seqs']} sequences (+{info['state_seqs']} prefix snapshots, "
            f"{info['state_bytes'] / 2**20:.0f} MiB) "
            if info.get("state_seqs")
            else ""
        )
        + f"max_model_len={runtime.max_model_len} tool_calls={runtime.tool_format} "
        f"reasoning={runtime.reasoning_format or 'none'}"
        + (f" adapters={','.join(runtime.adapters)}" if runtime.adapters else "")
        + (f" scheduling={runtime.settings.scheduling_policy}" if runtime.settings.scheduling_policy != "fcfs" else "")
        + (" responses=redis" if runtime.settings.response_store_url else "")
        + _speculative(info.get("speculative"))
    )


def _speculative(spec: dict | None) -> str:
    if not spec:
        return ""
    extra = "".join(f",{k}={v}" for k, v in spec.items() if k not in ("method", "num_speculative_tokens"))
    return f" speculative={spec['method']}(k={spec['num_speculative_tokens']}{extra})"
