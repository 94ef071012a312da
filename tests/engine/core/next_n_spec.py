"""Tiny DeepSeek-V3 and GLM-4.5 targets whose checkpoints carry the next-n prediction layer (model.layers.{n}.*, which
transformers drops): one with random next-n tensors, the reference's case, and one-layer targets whose next-n layer
repeats the target's layer on the shifted tokens, so that many of its guesses are the target's next tokens."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.engine.model.family_parity import load_family
from tests.engine.model.mla_checkpoints import build_mla_checkpoint
from tests.engine.model.moe_checkpoints import build_moe_checkpoint

KINDS = ("deepseek_v3", "glm4_moe")
MLA_KINDS = ("deepseek_v3", "glm4_moe_lite")


def build_target(kind: str, path: Path, baked_model_path: Path, **change):
    """A tiny random `kind` checkpoint at `path` (config `change`d) with the baked model's tokenizer; returns the
    transformers model."""
    hf = (
        build_mla_checkpoint(kind, path, **change)
        if kind in MLA_KINDS
        else build_moe_checkpoint(kind, "hub", path, **change)
    )
    load_family(path, baked_model_path)
    return hf


def _rewrite(path: Path, n: int, extra: dict[str, torch.Tensor], layer_norms: dict[str, torch.Tensor]) -> None:
    """The checkpoint's model.layers.{n}.* replaced: its last layer's tensors (`layer_norms` in place of its two
    norms), and `extra` (enorm, eh_proj, ...)."""
    (file,) = path.glob("*.safetensors")
    state = {k: v for k, v in load_file(str(file)).items() if not k.startswith(f"model.layers.{n}.")}
    last, prefix = f"model.layers.{n - 1}.", f"model.layers.{n}."
    state |= {prefix + k.removeprefix(last): t.clone() for k, t in state.items() if k.startswith(last)}
    state |= {prefix + k: t.contiguous() for k, t in {**layer_norms, **extra}.items()}
    save_file(state, str(file), metadata={"format": "pt"})


def add_random_next_n(path: Path, hf, *, own: bool, seed: int = 1) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    """Random next-n tensors (with the layer's own embedding and head where `own`, else the target's are read) and
    a copy of the target's last layer with their layer norms; returns (the tensors, less model.layers.{n}., the
    copy): the reference's weights."""
    gen = torch.Generator().manual_seed(seed)
    h, v, n = hf.config.hidden_size, hf.config.vocab_size, hf.config.num_hidden_layers

    def norm() -> torch.Tensor:
        return 1.0 + 0.2 * torch.randn(h, generator=gen)

    tensors = {
        "enorm.weight": norm(),
        "hnorm.weight": norm(),
        "eh_proj.weight": 0.15 * torch.randn(h, 2 * h, generator=gen),
        "shared_head.norm.weight": norm(),
    }
    if own:
        tensors["embed_tokens.weight"] = 0.15 * torch.randn(v, h, generator=gen)
        tensors["shared_head.head.weight"] = 0.15 * torch.randn(v, h, generator=gen)
    layer_norms = {"input_layernorm.weight": norm(), "post_attention_layernorm.weight": norm()}
    _rewrite(path, n, tensors, layer_norms)
    layer = copy.deepcopy(hf.model.layers[n - 1])
    with torch.no_grad():
        layer.input_layernorm.weight.copy_(layer_norms["input_layernorm.weight"])
        layer.post_attention_layernorm.weight.copy_(layer_norms["post_attention_layernorm.weight"])
    return tensors, layer


def add_agreeing_next_n(path: Path, hf) -> None:
    """For a one-layer target: embedding rows of unit RMS (in the checkpoint), and a next-n layer that passes
    enorm(embedding) = embedding through eh_proj ([I | 0]) into a copy of the target's layer, then the target's final
    norm and lm_head. At head position p it runs the target's layer on tokens 1..p+1, as the target ran it on tokens
    0..p+1 (rotary is relative): its guess for token p+2 is the target's, but for the missing first token."""
    (file,) = path.glob("*.safetensors")
    state = load_file(str(file))
    embed = state["model.embed_tokens.weight"]
    state["model.embed_tokens.weight"] = embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True))
    save_file(state, str(file), metadata={"format": "pt"})
    h = hf.config.hidden_size
    layer = {k: state[f"model.layers.0.{k}"] for k in ("input_layernorm.weight", "post_attention_layernorm.weight")}
    tensors = {
        "enorm.weight": torch.ones(h),
        "hnorm.weight": torch.ones(h),
        "eh_proj.weight": torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1),
        "shared_head.norm.weight": state["model.norm.weight"],
    }
    _rewrite(path, 1, tensors, layer)
