"""GET /v1/models and /v1/models/{id}, and which model (the base, or one of its LoRA adapters) a request names."""

from __future__ import annotations

from typing import Any

from worker.openai.errors import ModelNotFound
from worker.openai.runtime import Runtime

OWNED_BY = "runpod"


def model_card(runtime: Runtime, name: str, adapter: str | None = None) -> dict[str, Any]:
    """The base model's card, or an adapter's, whose `parent` names the base (as vLLM lists LoRA modules)."""
    return {
        "id": name,
        "object": "model",
        "created": runtime.created,
        "owned_by": OWNED_BY,
        "root": runtime.served_model_name if adapter is None else adapter,
        "parent": None if adapter is None else runtime.served_model_name,
        "max_model_len": runtime.max_model_len,
    }


def list_models(runtime: Runtime) -> dict[str, Any]:
    """The served model under its primary name (the override when one is set), then each adapter."""
    cards = [model_card(runtime, runtime.served_model_name)]
    cards += [model_card(runtime, name, name) for name in runtime.adapters]
    return {"object": "list", "data": cards}


def retrieve_model(runtime: Runtime, model_id: str) -> dict[str, Any]:
    _, adapter = resolve_model(runtime, model_id)
    return model_card(runtime, model_id, adapter)


def resolve_model(runtime: Runtime, model: str) -> tuple[str, str | None]:
    """(the name responses carry, the LoRA adapter or None) for a request's `model`: a name of the base model, an
    adapter's name, or SGLang's "<base>:<adapter>". Anything else is ModelNotFound (404)."""
    if model in runtime.model_names:
        return runtime.served_model_name, None
    base, _, adapter = model.rpartition(":")
    if model in runtime.adapters or (base in runtime.model_names and adapter in runtime.adapters):
        return model, adapter
    served = f"`{runtime.served_model_name}`"
    if runtime.adapters:
        served += " and its adapters " + ", ".join(f"`{a}`" for a in runtime.adapters)
    raise ModelNotFound(f"The model `{model}` does not exist. This worker serves {served}.", param="model")
