"""IBM Granite 3.x: dense (GraniteForCausalLM) and mixture-of-experts (GraniteMoeForCausalLM, and
GraniteMoeSharedForCausalLM with a shared MLP beside the experts). The Llama decoder with Granite's four scalars
(LlamaArgs: embedding, residual and attention multipliers, logits scaling); the MoE routes by a softmax over the
chosen k. Hub checkpoints name the MoE `block_sparse_moe` with `router.layer`, its experts stacked as `input_linear`
(gate|up) and `output_linear` (down), the shared MLP `shared_mlp` (the same two names); transformers 5 writes
`router` and `experts.gate_up_proj` / `experts.down_proj`.
"""

from __future__ import annotations

import dataclasses
import re

from engine.model.layers.moe import SparseMoE
from engine.model.models.llama import LlamaArgs, LlamaForCausalLM
from engine.model.models.moe_base import MoeArgs, MoeForCausalLM, read_moe_args, shared_mlp

_RENAMES = (
    (re.compile(r"\.block_sparse_moe\.router(\.layer)?\."), ".mlp.gate."),
    (re.compile(r"\.block_sparse_moe\.(input_linear\.weight|experts\.gate_up_proj)$"), ".mlp.experts.gate_up_proj"),
    (re.compile(r"\.block_sparse_moe\.(output_linear\.weight|experts\.down_proj)$"), ".mlp.experts.down_proj"),
    (re.compile(r"\.shared_mlp\.input_linear\."), ".mlp.shared_experts.gate_up_proj."),
    (re.compile(r"\.shared_mlp\.output_linear\."), ".mlp.shared_experts.down_proj."),
)


def granite_moe_name(name: str) -> str:
    """A Granite MoE checkpoint's name (the hub's or transformers 5's) as the engine's `mlp.*`."""
    for pattern, ours in _RENAMES:
        name = pattern.sub(ours, name)
    return name


def granite_scalars(config: dict) -> dict:
    scale = config.get("attention_multiplier")
    return {
        "embedding_multiplier": float(config.get("embedding_multiplier", 1.0)),
        "residual_multiplier": float(config.get("residual_multiplier", 1.0)),
        "attention_multiplier": None if scale is None else float(scale),
        "logits_scaling": float(config.get("logits_scaling", 1.0)),
    }


class GraniteForCausalLM(LlamaForCausalLM):
    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> LlamaArgs:
        return dataclasses.replace(super().read_args(config, names), **granite_scalars(config))


class GraniteMoeForCausalLM(MoeForCausalLM):
    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> MoeArgs:
        args = read_moe_args(
            config,
            names,
            expert_size_key="intermediate_size",
            norm_topk_prob=True,
            shared_expert_size=config.get("shared_intermediate_size") or 0,
        )
        return dataclasses.replace(args, **granite_scalars(config))

    @classmethod
    def make_moe(cls, a: MoeArgs) -> SparseMoE:
        """The routed experts and, where the config has one, the ungated shared MLP beside them."""
        assert a.routing is not None
        return SparseMoE(routing=a.routing, hidden_size=a.hidden_size, shared_experts=shared_mlp(a))

    def checkpoint_name(self, name: str) -> str:
        return granite_moe_name(name)
