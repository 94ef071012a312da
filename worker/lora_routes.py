"""vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters loaded and unloaded while serving,
with VLLM_ALLOW_RUNTIME_LORA_UPDATING on (404s otherwise, as vLLM has no such routes then)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from engine.config import AdapterSpec, check_adapter_name
from engine.errors import StartupError, UnsupportedModel
from worker.lora_sources import locate_adapter
from worker.openai.errors import AdapterNotFound, BadRequest, RouteNotFound
from worker.runtime import Runtime

log = logging.getLogger("worker")

LOAD = "/v1/load_lora_adapter"
UNLOAD = "/v1/unload_lora_adapter"


async def load_lora_adapter(body: Any, runtime: Runtime) -> str:
    """vLLM's body {"lora_name", "lora_path"}: the adapter is read, checked and served under lora_name."""
    _check_enabled(runtime, LOAD)
    name, path = _field(body, "lora_name"), _field(body, "lora_path")
    try:
        check_adapter_name(name, "lora_name")
    except StartupError as exc:
        raise BadRequest(exc.message, param="lora_name") from None
    if name in runtime.model_names or name in runtime.adapters:
        raise BadRequest(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
    folder = await asyncio.to_thread(locate_adapter, AdapterSpec(name, path), runtime.settings)
    try:
        await runtime.engine.load_adapter(name, folder)
    except UnsupportedModel as exc:
        raise BadRequest(exc.message, param="lora_path") from None
    log.info("loaded LoRA adapter %r from %s", name, path)
    return f"Success: LoRA adapter '{name}' added successfully."


async def unload_lora_adapter(body: Any, runtime: Runtime) -> str:
    """vLLM's body {"lora_name"}: new requests may no longer name it; running ones finish with it."""
    _check_enabled(runtime, UNLOAD)
    name = _field(body, "lora_name")
    if name not in runtime.adapters:
        raise AdapterNotFound(f"The lora adapter '{name}' cannot be found.", param="lora_name")
    await runtime.engine.unload_adapter(name)
    log.info("unloaded LoRA adapter %r", name)
    return f"Success: LoRA adapter '{name}' removed successfully."


def _check_enabled(runtime: Runtime, route: str) -> None:
    if not runtime.engine.adapters_at_run_time:
        why = "ENABLE_LORA is off" if not runtime.settings.enable_lora else "set VLLM_ALLOW_RUNTIME_LORA_UPDATING=true"
        raise RouteNotFound(
            f"{route} is off on this worker ({why} to load and unload adapters while serving)", param="openai_route"
        )


def _field(body: Any, name: str) -> str:
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, str) or not value.strip():
        raise BadRequest(f"'{name}' must be provided, as a non-empty string", param=name)
    return value.strip()
