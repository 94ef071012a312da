"""The checks a model folder passes before it is served: the bake runs them on what it stages, the worker on a
hub cache snapshot it serves in place. Each failure is one line naming what is missing."""

from __future__ import annotations

import json
from pathlib import Path

from engine.errors import UnsupportedModel


def check_model_folder(folder: Path) -> str:
    """Raise UnsupportedModel (one line) unless the folder holds config.json, safetensors weights, a tokenizer and
    tokenizer_config.json, and a checkpoint the engine runs (architecture, tensor shapes, quantization, and the model
    built from its config as start-up builds it: rotary, KV groups, KV scales). Returns the architecture."""
    from engine.model.classifier import refuse_encoder
    from engine.model.loader import check_checkpoint
    from engine.model.models import ARCHITECTURES, refuse_not_built

    config_path = folder / "config.json"
    if not config_path.is_file():
        raise UnsupportedModel("the model has no config.json", param="model")
    archs = json.loads(config_path.read_text()).get("architectures") or []
    for arch in archs:
        refuse_encoder(arch)
        refuse_not_built(arch)
    supported = [a for a in archs if a in ARCHITECTURES]
    if not supported:
        raise UnsupportedModel(
            f"architecture {', '.join(archs) or '(none given)'} is not supported by the engine; "
            f"supported: {', '.join(sorted(ARCHITECTURES))}",
            param="model",
        )
    if not list(folder.glob("*.safetensors")):
        raise UnsupportedModel("the model has no weights (*.safetensors or *.bin)", param="model")
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer.model").is_file():
        raise UnsupportedModel("the model has no tokenizer (tokenizer.json or tokenizer.model)", param="model")
    if not (folder / "tokenizer_config.json").is_file():
        raise UnsupportedModel("the model has no tokenizer_config.json", param="model")
    try:
        check_checkpoint(str(folder))
    except UnsupportedModel as exc:
        raise UnsupportedModel(f"the engine cannot run this model: {exc}", param="model") from None
    return supported[0]
