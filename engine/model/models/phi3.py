"""Phi-3 / Phi-3.5 / Phi-4 / Phi-4-mini (Phi3ForCausalLM): the Llama decoder, its checkpoints storing q|k|v and
gate|up fused (the layout FusedLinear holds, read as they are; a tensor-parallel rank reads its part of each piece,
as engine/model/sharding.py plans for any fused tensor).
Phi-4-mini rotates the first partial_rotary_factor of each head (as GLM-4.5). The long-context releases use LongRoPE
(rope type `longrope`, written `su` or `yarn` by the older configs, which transformers reads as longrope): short and
long factors, one set chosen by the served context (engine/model/layers/rotary.py).
"""

from __future__ import annotations

from engine.model.layers.rotary import rope_parameters
from engine.model.models.llama import LlamaArgs, LlamaForCausalLM

LONGROPE_ALIASES = ("su", "yarn")  # transformers' Phi3Config: the rope types the first Phi-3 releases wrote


def phi_rope(config: dict) -> dict:
    """The config's rope parameters as transformers' Phi-3 config reads them: the old LongRoPE names as longrope,
    original_max_position_embeddings from the top level where the rope parameters leave it out."""
    rope = rope_parameters(config)
    if rope["rope_type"] in LONGROPE_ALIASES:
        rope["rope_type"] = "longrope"
    if rope["rope_type"] == "longrope" and config.get("original_max_position_embeddings"):
        rope.setdefault("original_max_position_embeddings", config["original_max_position_embeddings"])
    return rope


class Phi3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> LlamaArgs:
        args = super().read_args(config, names)
        args.rope = phi_rope(config)
        args.partial_rotary = float(args.rope.get("partial_rotary_factor", 1.0)) != 1.0
        return args
