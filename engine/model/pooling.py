"""How a model turns its final hidden states into one embedding: read from its sentence-transformers files.

A folder with `modules.json` says it: a Transformer module, then Pooling (its `config.json` picks mean, CLS or
last token), then optionally Normalize. A folder without them pools the last token and normalises, as vLLM does
for decoder models. Shortening (`dimensions`) is allowed only for a model whose config.json says it was trained
for it, under the keys vLLM reads: `matryoshka_dimensions` (the sizes allowed) or `is_matryoshka`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from engine.errors import UnsupportedModel
from engine.model.classifier import ENCODER_MODELS

# sentence-transformers' pooling_mode_* flags -> the engine's method
POOLING_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}
MODULE_KINDS = {
    "sentence_transformers.models.Transformer": "transformer",
    "sentence_transformers.models.Pooling": "pooling",
    "sentence_transformers.models.Normalize": "normalize",
}


@dataclass(frozen=True, kw_only=True)
class PoolingConfig:
    """The model's pooling: method ("mean", "cls" or "last"), whether it normalises, which sizes it shortens to."""

    method: str = "last"
    normalize: bool = True
    source: str = "default"  # "sentence-transformers" when read from the model's modules.json
    matryoshka: bool = False  # the model may be shortened (dimensions)
    matryoshka_dimensions: tuple[int, ...] | None = None  # the sizes allowed, when the config lists them
    # A bidirectional encoder's: every row sees the whole prompt, so it runs in one chunk and skips the prefix cache
    whole_prompt: bool = False


def read_pooling(model_path: str, config: dict) -> PoolingConfig:
    """The folder's pooling; raises UnsupportedModel (one line) for a module or pooling mode the engine lacks. An
    encoder (BERT-like) without modules.json pools its CLS token and normalises, as vLLM does."""
    dims = config.get("matryoshka_dimensions")
    matryoshka = bool(dims) or bool(config.get("is_matryoshka"))
    allowed = tuple(int(d) for d in dims) if dims else None
    modules_path = os.path.join(model_path, "modules.json")
    if not os.path.isfile(modules_path):
        default = "cls" if (config.get("architectures") or [""])[0] in ENCODER_MODELS else "last"
        return PoolingConfig(method=default, matryoshka=matryoshka, matryoshka_dimensions=allowed)
    with open(modules_path) as f:
        modules = json.load(f)
    method, normalize = None, False
    for module in modules:
        kind = MODULE_KINDS.get(module.get("type", ""))
        if kind is None:
            raise UnsupportedModel(
                f"sentence-transformers module {module.get('type')!r} ({module.get('path')}) in "
                "modules.json is not supported (only Transformer, Pooling and Normalize)"
            )
        if kind == "pooling":
            method = _pooling_method(os.path.join(model_path, module.get("path", ""), "config.json"))
        normalize = normalize or kind == "normalize"
    if method is None:
        raise UnsupportedModel("modules.json has no Pooling module: the model does not say how to pool")
    return PoolingConfig(
        method=method,
        normalize=normalize,
        source="sentence-transformers",
        matryoshka=matryoshka,
        matryoshka_dimensions=allowed,
    )


def _pooling_method(path: str) -> str:
    if not os.path.isfile(path):
        raise UnsupportedModel(
            f"the Pooling module's {os.path.relpath(path, os.path.dirname(os.path.dirname(path)))} is missing"
        )
    with open(path) as f:
        pooling = json.load(f)
    on = [key for key, value in pooling.items() if key.startswith("pooling_mode_") and value]
    if len(on) != 1 or on[0] not in POOLING_MODES:
        raise UnsupportedModel(
            f"pooling mode {', '.join(on) or '(none)'} is not supported (one of {', '.join(sorted(POOLING_MODES))})"
        )
    return POOLING_MODES[on[0]]
