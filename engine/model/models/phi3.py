"""Phi-3 / Phi-3.5 / Phi-4 / Phi-4-mini (Phi3ForCausalLM): the Llama decoder, its checkpoints storing q|k|v and
gate|up fused (the layout FusedLinear holds, read as they are; a tensor-parallel rank reads its part of each piece).
Phi-4-mini rotates the first partial_rotary_factor of each head (as GLM-4.5). LongRoPE (rope type `longrope`: short
and long factors chosen by the sequence's length) is not run: such a checkpoint is refused in one line.
"""

from __future__ import annotations

from engine.errors import UnsupportedModel
from engine.model.checkpoint import Source
from engine.model.layers.parallel import TensorParallel
from engine.model.models.llama import LlamaArgs, LlamaForCausalLM
from engine.model.sharding import ShardPlan


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

    def shard(self, tp: TensorParallel) -> ShardPlan:
        """The Llama shard, and this rank's rows of each piece of the fused checkpoint tensors: its query heads',
        its KV heads' keys and values; its columns of gate and of up."""
        plan = super().shard(tp)
        a = self.args
        d, q_rows, kv_rows = a.head_dim, a.num_q_heads * a.head_dim, a.num_kv_heads * a.head_dim
        (q0, nq), (k0, nk) = tp.span(a.num_q_heads), tp.kv_heads(a.num_kv_heads)
        (c0, nc), inner = tp.span(a.intermediate_size), a.intermediate_size
        qkv = ((q0 * d, nq * d), (q_rows + k0 * d, nk * d), (q_rows + kv_rows + k0 * d, nk * d))
        for i in range(a.num_layers):
            plan.sources[f"model.layers.{i}.self_attn.qkv_proj.weight"] = Source(0, qkv)
            plan.sources[f"model.layers.{i}.mlp.gate_up_proj.weight"] = Source(0, ((c0, nc), (inner + c0, nc)))
        return plan
