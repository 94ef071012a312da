"""Tiny multi-head latent attention (MLA) checkpoints (mla_checkpoints.py) in the quantized layouts the hub ships:
DeepSeek-V3 / R1's own FP8 release (and GLM-4.7-Flash-FP8's): `quant_method: fp8`, e4m3 weights with a
weight_scale_inv per block on every projection of the decoder (q_a_proj / q_b_proj or q_proj, kv_a_proj_with_mqa,
kv_b_proj, o_proj, the dense MLPs, shared experts and every routed expert), the routers and their correction bias,
the norms, embeddings and lm_head in float; compressed-tensors FP8 (per channel) and W4A16, AutoAWQ's and
AutoGPTQ's int4 on the same projections. The tiny FP8 blocks are 32 x 24 so that no width is a whole number of them
(partial edge blocks on rows and columns, rows and columns told apart); int4 needs inputs in whole groups of 128,
so its models are wider.

The writer returns the transformers model holding the float32 weights the checkpoint stands for."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.engine.model.mla_checkpoints import build_mla_checkpoint
from tests.engine.model.quant_writers import WRITERS, fp8_block_tensors, quantization_config, reference_slot

FP8_BLOCK = (32, 24)
# every quantized input width a multiple of AWQ's group of 128, every output width of its 8 columns per word
INT4_SIZES = dict(
    hidden_size=128,
    q_lora_rank=128,
    kv_lora_rank=128,
    v_head_dim=32,
    intermediate_size=128,
    moe_intermediate_size=128,
)
INT4 = ("awq", "gptq", "ct_int4")
QUANTIZED = re.compile(
    r"\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|up_proj|down_proj|eh_proj)\.weight$"
)


def deepseek_fp8_config(block: tuple[int, int] = FP8_BLOCK) -> dict:
    """DeepSeek-V3's quantization_config as its release ships it (blocks of 128 x 128 there)."""
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block)}


def write_mla_quantized(kind: str, family: str, path: Path, block: tuple[int, int] = FP8_BLOCK, **sizes: object):
    """The tiny `family` (mla_checkpoints.CONFIGS, with `sizes` changed) saved in `kind`'s format ("fp8_block":
    DeepSeek's own, in blocks of `block`, or a quant_writers.WRITERS kind); returns the transformers model holding
    the weights it stands for (float32)."""
    hf = build_mla_checkpoint(family, path, **{**(INT4_SIZES if kind in INT4 else {}), **sizes})
    quantize_folder(kind, path, hf.state_dict(), block)
    return hf


def quantize_folder(kind: str, path: Path, state: dict[str, torch.Tensor] | None, block: tuple[int, int]) -> None:
    """Rewrites the checkpoint at `path` in `kind`'s format (a next-n layer's projections and eh_proj too); `state`:
    the transformers model's tensors, set to the weights the checkpoint now stands for."""
    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if QUANTIZED.search(n)]:
        w = tensors.pop(name).float()
        quantized, reference = fp8_block_tensors(w, block) if kind == "fp8_block" else WRITERS[kind](w)
        module = name.removesuffix(".weight")
        tensors.update({f"{module}.{k}": v.contiguous() for k, v in quantized.items()})
        if state is not None:
            with torch.no_grad():
                reference_slot(state, name).copy_(reference)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    routers = sorted(n.removesuffix(".weight") for n in tensors if re.search(r"\.mlp\.gate\.weight$", n))
    config["quantization_config"] = (
        deepseek_fp8_config(block) if kind == "fp8_block" else quantization_config(kind, tuple(routers))
    )
    (path / "config.json").write_text(json.dumps(config))


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """DeepSeek's rule, written out: weight.float() times the scale_inv of the block each element sits in (the last
    row and column blocks partial)."""
    rows, cols = weight.shape
    per_element = scale_inv.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return weight.float() * per_element
