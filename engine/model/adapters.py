"""LoRA adapters in PEFT's layout (adapter_config.json + adapter_model.safetensors): checked against a model, read.

Only what the engine applies exactly is accepted: LoRA on the attention and MLP projections (attention only on
a mixture-of-experts model), without DoRA, trained biases, extra saved modules or per-module rank patterns.
Anything else is refused with one line rather than served half applied.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.errors import UnsupportedModel

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
# PEFT's key of one LoRA matrix: base_model.model.model.layers.<i>.<self_attn|mlp>.<proj>.lora_<A|B>.weight
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# Parts of a key that mark an MoE router or expert (the engine applies no LoRA there).
_MOE_PARTS = (".experts.", ".block_sparse_moe.", ".shared_expert", ".mlp.gate.")
# Config flags that change what the adapter computes; each must be off (falsy) for the engine to serve it.
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "modules_to_save (fully trained extra modules)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "fan_in_fan_out": "fan_in_fan_out weights",
    "lora_bias": "trained LoRA biases (lora_bias)",
    "target_parameters": "target_parameters",
}


@dataclass(kw_only=True)
class AdapterInfo:
    """What the manifest and the engine need to know about one checked adapter."""

    rank: int
    lora_alpha: float
    scale: float  # lora_alpha / rank, or lora_alpha / sqrt(rank) with use_rslora
    target_modules: list[str]  # the projections its weights change
    base_model: str | None = None  # base_model_name_or_path, as the adapter's trainer wrote it
    layers: dict[tuple[int, str], tuple[str, str]] = field(default_factory=dict, repr=False)  # -> (A key, B key)


def projection_shapes(config: Any) -> dict[str, tuple[int, int]]:
    """(out, in) features of each LoRA target in a Llama-family decoder layer, from its transformers config."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    q, kv, inter = heads * head_dim, kv_heads * head_dim, config.intermediate_size
    attention = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q)}
    if getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None):
        return attention  # a mixture of experts: its MLPs are experts, which no adapter may change
    return {
        "q_proj": (q, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, q),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }


def check_adapter(folder: Path, shapes: dict[str, tuple[int, int]], num_layers: int) -> AdapterInfo:
    """The adapter's rank, scale and targets; UnsupportedModel (one line) unless it fits the model exactly."""
    folder = Path(folder)
    config = _read_config(folder)
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise UnsupportedModel(f"the adapter uses {what}, which the engine does not apply", param="model")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise UnsupportedModel(f"the adapter is {config['peft_type']}, not LoRA", param="model")
    if config.get("bias", "none") != "none":
        raise UnsupportedModel(
            f"the adapter trains biases (bias={config['bias']!r}); only 'none' is supported", param="model"
        )
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1 or not isinstance(alpha, (int, float)):
        raise UnsupportedModel(f"{ADAPTER_CONFIG} needs a positive integer r and a number lora_alpha", param="model")
    layers = _layer_keys(folder / ADAPTER_WEIGHTS, shapes, num_layers, rank)
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    targets = [t for t in TARGETS if any(name == t for _, name in layers)]
    return AdapterInfo(
        rank=rank,
        lora_alpha=float(alpha),
        scale=scale,
        target_modules=targets,
        base_model=config.get("base_model_name_or_path"),
        layers=layers,
    )


def read_adapter(folder: Path, info: AdapterInfo) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, target) -> (A [rank, in], B [out, rank]) in float32, for an adapter check_adapter accepted."""
    out = {}
    with safe_open(str(Path(folder) / ADAPTER_WEIGHTS), framework="pt") as f:
        for where, (a_key, b_key) in info.layers.items():
            out[where] = (f.get_tensor(a_key).float(), f.get_tensor(b_key).float())
    return out


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / ADAPTER_CONFIG
    if not path.is_file():
        raise UnsupportedModel(f"{folder.name} is not a PEFT adapter (no {ADAPTER_CONFIG})", param="model")
    if not (folder / ADAPTER_WEIGHTS).is_file():
        found = (
            " (adapter_model.bin: save it with safe_serialization=True)"
            if (folder / "adapter_model.bin").is_file()
            else ""
        )
        raise UnsupportedModel(f"the adapter has no {ADAPTER_WEIGHTS}{found}", param="model")
    try:
        config = json.loads(path.read_text())
    except ValueError as exc:
        raise UnsupportedModel(f"{ADAPTER_CONFIG} is not valid JSON: {exc}", param="model") from None
    if not isinstance(config, dict):
        raise UnsupportedModel(f"{ADAPTER_CONFIG} must hold a JSON object", param="model")
    return config


def _layer_keys(
    path: Path, shapes: dict[str, tuple[int, int]], num_layers: int, rank: int
) -> dict[tuple[int, str], tuple[str, str]]:
    """Every tensor must be the A or B of a supported projection, shaped for this model and this rank."""
    found: dict[tuple[int, str], dict[str, str]] = {}
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            match = _KEY.match(key)
            if any(part in key for part in _MOE_PARTS) or (
                match and match.group(2) in MLP_TARGETS and match.group(2) not in shapes
            ):
                raise UnsupportedModel(
                    f"the adapter changes {key!r}, an MoE expert or router; on a "
                    f"mixture-of-experts model only {', '.join(shapes)} take LoRA",
                    param="model",
                )
            if match is None or match.group(2) not in shapes:
                raise UnsupportedModel(
                    f"the adapter has tensor {key!r}; only LoRA A/B matrices of {', '.join(shapes)} are supported",
                    param="model",
                )
            layer, target, kind = int(match.group(1)), match.group(2), match.group(3)
            if layer >= num_layers:
                raise UnsupportedModel(
                    f"the adapter changes layer {layer}, but the model has {num_layers} layers "
                    "(it was trained for another base model)",
                    param="model",
                )
            out_features, in_features = shapes[target]
            want = (rank, in_features) if kind == "A" else (out_features, rank)
            got = tuple(f.get_slice(key).get_shape())
            if got != want:
                raise UnsupportedModel(
                    f"the adapter's {key} has shape {got}, this model needs {want} (it was "
                    "trained for another base model, or its r is wrong)",
                    param="model",
                )
            found.setdefault((layer, target), {})[kind] = key
    if not found:
        raise UnsupportedModel("the adapter has no LoRA weights", param="model")
    for (layer, target), pair in found.items():
        if len(pair) != 2:
            raise UnsupportedModel(
                f"the adapter has lora_A without lora_B (or the reverse) for layer {layer} {target}", param="model"
            )
    return {where: (pair["A"], pair["B"]) for where, pair in sorted(found.items())}
