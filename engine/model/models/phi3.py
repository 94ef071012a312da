"""Phi-3 / Phi-3.5 / Phi-4 / Phi-4-mini (Phi3ForCausalLM): the Llama decoder, its checkpoints storing q|k|v and
gate|up fused (the layout FusedLinear holds, read as they are; a tensor-parallel rank reads its part of each piece,
as engine/model/sharding.py plans for any fused tensor).
Phi-4-mini rotates the first partial_rotary_factor of each head (as GLM-4.5). LongRoPE (rope type `longrope`: short
and long factors chosen by the sequence's length) is not run: such a checkpoint is refused in one line.
"""

from __future__ import annotations

from engine.errors import UnsupportedModel
from engine.model.models.llama import LlamaArgs, LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> LlamaArgs:
        args = super().read_args(config, names)
        if args.rope.get("rope_type") == "longrope":
            raise UnsupportedModel(
                "rope type 'longrope' (Phi-3 / Phi-4-mini long context) is not supported", param="model"
            )
        args.partial_rotary = float(args.rope.get("partial_rotary_factor", 1.0)) != 1.0
        return args
