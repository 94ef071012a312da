"""Tiny hybrid (Gated DeltaNet + gated attention) checkpoints in the quantized layouts the hub ships them in.

Which modules each release quantizes, and what its config lists as left in float:
- Qwen's own `-FP8` (Qwen3.5-27B-FP8, Qwen3.5-35B-A3B-FP8, Qwen3-Next-80B-A3B-*-FP8): block FP8 (128 x 128,
  weight_scale_inv) on every projection of the decoder (in_proj_qkv, in_proj_z or the fused in_proj_qkvz, out_proj,
  q/k/v/o, the MLPs and every expert); modules_to_not_convert names lm_head, the embeddings, each DeltaNet layer's
  conv1d and in_proj_a / in_proj_b (Qwen3-Next: in_proj_ba, as vLLM notes "ba_proj doesn't support blockwise
  fp8"), the routers and shared-expert gates, the vision tower and mtp.fc.
- compressed-tensors pack-quantized W4A16 (llm-compressor's AWQ / GPTQ output, e.g. cyankiwi's Qwen3.5 AWQ-4bit,
  group 32 symmetric): the same projections, `ignore` naming in_proj_a / in_proj_b, conv1d, routers, shared-expert
  gates, the vision tower, mtp.fc and lm_head.
- AutoAWQ's GEMM layout (`quant_method: awq`, group 128): the same projections and modules_to_not_convert (AutoAWQ
  itself has no Qwen3-Next / Qwen3.5 support; such releases come from other tools writing its layout).

Each writer returns the transformers model holding the float32 weights the checkpoint stands for.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tests.engine.model.hybrid_checkpoints import build_hybrid_checkpoint
from tests.engine.model.quant_writers import (
    WRITERS,
    compressed_int4_scheme,
    compressed_int4_tensors,
    quantization_config,
    reference_slot,
)

# Whole 128-blocks and 128-groups: hidden 256, DeltaNet q|k|v 512 rows, z 256, q_proj (query|gate) 512 rows; k / v
# 128 rows. in_proj_a / in_proj_b keep 4 rows (num_v_heads), in_proj_ba 8, as small as the real ones are to a block.
HYBRID_QUANT = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=256,
)
# The hub's float modules of a hybrid decoder layer (their names as the checkpoint spells them).
FLOAT_MODULES = re.compile(r"\.(linear_attn\.(in_proj_a|in_proj_b|in_proj_ba)|mlp\.gate|mlp\.shared_expert_gate)$")


def write_hybrid_quantized(
    kind: str,
    model_type: str,
    path: Path,
    quantize: re.Pattern | None = None,
    mtp: Callable[[nn.Module], dict[str, torch.Tensor]] | None = None,
    **change,
):
    """A tiny random `model_type` hybrid saved in `kind`'s layout; `quantize` (module names) overrides which linears
    are quantized (default: every linear of the decoder but FLOAT_MODULES). Returns the transformers model with
    the weights the checkpoint stands for (float32). mtp(hf): the whole multi-token-prediction head to store
    (default: a stub of two tensors no test runs), quantized as the hub's releases store it; its dict then holds
    the float32 weights the checkpoint stands for."""
    hf = build_hybrid_checkpoint(model_type, path, **{**HYBRID_QUANT, **change})
    tensors = load_file(path / "model.safetensors")
    state = hf.state_dict()
    write = {"ct_int4_g32": lambda w: compressed_int4_tensors(w, group=32, symmetric=True)}.get(kind) or WRITERS[kind]
    # The multi-token-prediction head the hub checkpoints carry: its projections quantized, its fc left in float.
    head = (
        mtp(hf)
        if mtp is not None
        else {
            "mtp.fc.weight": torch.randn(HYBRID_QUANT["hidden_size"], 2 * HYBRID_QUANT["hidden_size"]),
            "mtp.layers.0.mlp.gate_proj.weight": torch.randn(
                HYBRID_QUANT["intermediate_size"], HYBRID_QUANT["hidden_size"]
            ),
        }
    )
    tensors.update(head)
    quantized = []
    for name in list(tensors):
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or tensors[name].dim() != 2 or not _quantized(module, quantize):
            continue
        packed, reference = write(tensors.pop(name).float())
        tensors.update({f"{module}.{k}": v.contiguous() for k, v in packed.items()})
        if module.startswith("mtp."):
            head[name] = reference
        else:
            with torch.no_grad():
                reference_slot(state, name).copy_(reference)
        quantized.append(module)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = hybrid_quantization_config(kind, sorted(set(_modules(tensors)) - set(quantized)))
    (path / "config.json").write_text(json.dumps(config))
    return hf


def hybrid_quantization_config(kind: str, float_modules: list[str]) -> dict:
    """The release's quantization_config, naming `float_modules` (every float module with a weight of two or more
    dimensions, lm_head among them) in its list of modules left alone."""
    if kind in ("awq", "fp8_block"):
        extra = {"fmt": "e4m3"} if kind == "fp8_block" else {}
        return {**quantization_config(kind), **extra, "modules_to_not_convert": float_modules}
    config = quantization_config("ct_int4", tuple(m for m in float_modules if m != "lm_head"))
    if kind == "ct_int4_g32":
        config["config_groups"] = {"group_0": compressed_int4_scheme(32, symmetric=True).model_dump(mode="json")}
    return config


def _quantized(module: str, quantize: re.Pattern | None) -> bool:
    if quantize is not None:
        return bool(quantize.search(module))
    inside = module.startswith(("model.layers.", "model.language_model.layers.", "mtp.layers."))
    return inside and not FLOAT_MODULES.search(module)


def _modules(tensors: dict[str, torch.Tensor]) -> list[str]:
    return [n.rpartition(".")[0] for n, t in tensors.items() if n.endswith(".weight") and t.dim() >= 2]
