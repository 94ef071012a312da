"""Qwen's Llama-attention MoE decoders: Qwen3-MoE (q/k norm per head) and Qwen2-MoE (qkv bias, a shared expert
with a sigmoid gate), on moe_base.py. Which layers are sparse follows transformers: `decoder_sparse_step` and
`mlp_only_layers`; the other layers keep the dense Llama MLP.
"""

from __future__ import annotations

from engine.model.layers.moe import SparseMoE
from engine.model.models.moe_base import MoeArgs, MoeForCausalLM, read_moe_args, shared_mlp


def qwen_sparse_layers(config: dict) -> tuple[int, ...]:
    """The layers transformers' Qwen MoE decoders give experts: not in mlp_only_layers, and every
    decoder_sparse_step-th layer."""
    step = config.get("decoder_sparse_step", 1) or 1
    dense = set(config.get("mlp_only_layers") or ())
    return tuple(i for i in range(config["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)


class Qwen3MoeForCausalLM(MoeForCausalLM):
    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> MoeArgs:
        return read_moe_args(
            config,
            names,
            expert_size_key="moe_intermediate_size",
            norm_topk_prob=None,
            sparse_layers=qwen_sparse_layers(config),
            qk_norm=True,
        )


class Qwen2MoeForCausalLM(MoeForCausalLM):
    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> MoeArgs:
        shared = config.get("shared_expert_intermediate_size") or 0
        return read_moe_args(
            config,
            names,
            expert_size_key="moe_intermediate_size",
            norm_topk_prob=None,
            shared_expert_size=shared,
            sparse_layers=qwen_sparse_layers(config),
        )

    @classmethod
    def make_moe(cls, a: MoeArgs) -> SparseMoE:
        return shared_expert_moe(a)


def shared_expert_moe(a: MoeArgs) -> SparseMoE:
    """Qwen's MoE block: the routed experts and, when the config has one, a SwiGLU shared expert of its own width
    under a sigmoid gate (Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE)."""
    return SparseMoE(routing=a.routing, hidden_size=a.hidden_size, shared_expert=shared_mlp(a))
