"""GET /v1/models and /v1/models/{id}, and the check that a request names the served model."""

from __future__ import annotations

from typing import Any

from worker.openai.errors import ModelNotFound
from worker.runtime import Runtime

OWNED_BY = "runpod"


def model_card(runtime: Runtime, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": runtime.created,
        "owned_by": OWNED_BY,
        "root": runtime.served_model_name,
        "max_model_len": runtime.max_model_len,
    }


def list_models(runtime: Runtime) -> dict[str, Any]:
    """The served model under its primary name (the override when one is set)."""
    return {"object": "list", "data": [model_card(runtime, runtime.served_model_name)]}


def retrieve_model(runtime: Runtime, model_id: str) -> dict[str, Any]:
    check_model(runtime, model_id)
    return model_card(runtime, model_id)


def check_model(runtime: Runtime, model: str) -> str:
    """The name responses carry, once `model` is one this worker serves; else ModelNotFound (404)."""
    if model not in runtime.model_names:
        raise ModelNotFound(f"The model `{model}` does not exist. This worker serves "
                            f"`{runtime.served_model_name}`.", param="model")
    return runtime.served_model_name
