"""Random LoRA adapters in PEFT's layout for tests, and the merged weights they stand for.

B is random, not PEFT's zero init: an adapter whose B is zero changes nothing and would let a test pass
that ignores it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MLP = {"gate_proj", "up_proj", "down_proj"}


def peft_key(layer: int, target: str, kind: str) -> str:
    module = "mlp" if target in MLP else "self_attn"
    return f"base_model.model.model.layers.{layer}.{module}.{target}.lora_{kind}.weight"


def write_adapter(
    folder: Path,
    shapes: dict[str, tuple[int, int]],
    num_layers: int,
    *,
    targets: list[str],
    rank: int = 4,
    alpha: float = 8.0,
    seed: int = 0,
    std: float = 0.1,
    layers: list[int] | None = None,
    **config: Any,
) -> dict[str, torch.Tensor]:
    """Writes adapter_config.json + adapter_model.safetensors; returns the tensors by PEFT key.

    shapes: (out, in) per target, e.g. engine.model.adapters.projection_shapes(transformers_config)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers) if layers is None else layers:
        for target in targets:
            out_features, in_features = shapes[target]
            tensors[peft_key(layer, target, "A")] = torch.randn(rank, in_features, generator=gen) * std
            tensors[peft_key(layer, target, "B")] = torch.randn(out_features, rank, generator=gen) * std
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    settings = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": targets,
        "bias": "none",
        "base_model_name_or_path": "test-base",
        "task_type": "CAUSAL_LM",
        **config,
    }
    (folder / "adapter_config.json").write_text(json.dumps(settings))
    return tensors


def merge_into(hf_model: torch.nn.Module, tensors: dict[str, torch.Tensor], scale: float) -> None:
    """W += scale * B @ A for every adapted projection of a transformers model (in place)."""
    params = dict(hf_model.named_parameters())
    with torch.no_grad():
        for key, a in tensors.items():
            if ".lora_A." not in key:
                continue
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            params[name] += scale * (b @ a)
