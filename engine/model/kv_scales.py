"""A checkpoint's FP8 KV cache scales: one K and one V scale per attention layer (pages hold K / k_scale).

Read from the names the hub's FP8 checkpoints use: compressed-tensors' kv_cache_scheme writes
`self_attn.k_scale` / `v_scale` (older llm-compressor: `k_proj.output_scale` / `v_proj.output_scale`),
ModelOpt `k_proj.k_scale` / `v_proj.v_scale`. They apply only with KV_CACHE_DTYPE=fp8; a layer without one
keeps 1.0.
"""

from __future__ import annotations

from safetensors import safe_open
from torch import nn

from engine.errors import UnsupportedModel

# checkpoint name suffix -> the attention module's attribute it sets
KV_SCALE_SUFFIXES = {
    "self_attn.k_scale": "k_scale",
    "self_attn.v_scale": "v_scale",
    "self_attn.k_proj.output_scale": "k_scale",
    "self_attn.v_proj.output_scale": "v_scale",
    "self_attn.k_proj.k_scale": "k_scale",
    "self_attn.v_proj.v_scale": "v_scale",
}
KV_SCHEME = {"type": "float", "num_bits": 8}


def kv_scale_target(name: str) -> tuple[str, str] | None:
    """(attention module name, attribute) that a checkpoint tensor's KV scale sets; None for other tensors."""
    for suffix, attr in KV_SCALE_SUFFIXES.items():
        if name.endswith("." + suffix):
            return name[: -len(suffix)] + "self_attn", attr
    return None


def check_kv_cache_scheme(config: dict) -> None:
    """A quantization_config's kv_cache_scheme must describe per-tensor FP8 (the only KV scales the engine reads)."""
    scheme = (config.get("quantization_config") or {}).get("kv_cache_scheme")
    if not scheme:
        return
    kind = (scheme.get("type"), scheme.get("num_bits"), scheme.get("strategy", "tensor"))
    if kind != ("float", 8, "tensor") or not scheme.get("symmetric", True):
        raise UnsupportedModel(
            f"kv_cache_scheme {kind[1]}-bit {kind[0]} per {kind[2]} is not supported (8-bit float per tensor)",
            param="model",
        )


def kv_scale_places(model: nn.Module, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[str, str]]:
    """Checkpoint name -> (attention module, attribute) of each KV scale the checkpoint holds, from its headers alone
    (the bake asks it too); UnsupportedModel for a scale that is not per tensor or whose layer the model lacks."""
    wanted = {name: target for name in shapes if (target := kv_scale_target(name)) is not None}
    for name, (module, _) in wanted.items():
        if len(shapes[name]) > 1 or (shapes[name] and shapes[name][0] != 1):
            raise UnsupportedModel(
                f"KV cache scale {name!r} has shape {shapes[name]}: only per-tensor KV scales are supported",
                param="model",
            )
        try:
            model.get_submodule(module)
        except AttributeError:
            raise UnsupportedModel(f"unexpected tensor {name!r} in checkpoint", param="model") from None
    return wanted


def load_kv_scales(model: nn.Module, files: list[str], shapes: dict[str, tuple[int, ...]]) -> int:
    """Sets each attention module's k_scale / v_scale from the checkpoint; returns how many it set."""
    wanted = kv_scale_places(model, shapes)
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name in wanted:
                    module, attr = wanted[name]
                    setattr(model.get_submodule(module), attr, float(f.get_tensor(name).float().item()))
    return len(wanted)
