"""What the Llama-attention MoE decoders share (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, gpt-oss): their args, read
from a MoE config, and the Llama decoder whose sparse layers' MLP is a SparseMoE."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from engine.errors import UnsupportedModel
from engine.model.layers.moe import SparseMoE
from engine.model.layers.parallel import TensorParallel
from engine.model.layers.routing import Routing, check_routing
from engine.model.models.llama import LlamaArgs, LlamaForCausalLM, LlamaMLP
from engine.model.sharding import ShardPlan, shard_experts


@dataclass(kw_only=True)
class MoeArgs(LlamaArgs):
    """A Llama decoder's shape plus its experts: `routing`, and which layers run it (`sparse_layers`)."""

    routing: Routing | None = None
    sparse_layers: tuple[int, ...] = ()
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to +-clip_qkv

    @property
    def activation_width(self) -> int:
        """Per token, the widest MLP activation a step holds: the dense MLP's, or k experts' (plus the shared
        expert and k rows of hidden size for the grouped tokens). CUDA start-up sizes its budget from it."""
        r = self.routing
        return max(self.intermediate_size, r.top_k * (r.intermediate_size + self.hidden_size) + r.shared_expert_size)


def read_moe_args(
    config: dict,
    names: set[str],
    *,
    expert_size_key: str,
    norm_topk_prob: bool | None,
    shared_expert_size: int = 0,
    sparse_layers: tuple[int, ...] | None = None,
    qk_norm: bool = False,
) -> MoeArgs:
    """MoeArgs from a MoE config; `norm_topk_prob` None reads the config key (default False as transformers),
    `sparse_layers` None means every layer. UnsupportedModel naming the key for what the layer does not run."""
    if config.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"hidden_act {config['hidden_act']!r} is not supported", param="model")
    check_routing(config)
    # transformers 5 writes num_local_experts for every family (num_experts is an alias of it in some).
    num_experts = config.get("num_local_experts") or config.get("num_experts")
    if not num_experts:
        raise KeyError("num_experts")
    top_k = config["num_experts_per_tok"]
    if not 0 < top_k <= num_experts:
        raise UnsupportedModel(f"num_experts_per_tok={top_k} must be in 1..{num_experts}", param="model")
    if norm_topk_prob is None:
        norm_topk_prob = bool(config.get("norm_topk_prob", False))
    routing = Routing(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=config[expert_size_key],
        norm_topk_prob=norm_topk_prob,
        shared_expert_size=shared_expert_size,
    )
    num_layers = config["num_hidden_layers"]
    sparse = tuple(range(num_layers)) if sparse_layers is None else sparse_layers
    return MoeArgs.from_config(config, names, qk_norm=qk_norm, routing=routing, sparse_layers=sparse)


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama decoder whose sparse layers' MLP is a SparseMoE (the family's routing)."""

    @classmethod
    def make_mlp(cls, args: MoeArgs, index: int) -> nn.Module:
        return cls.make_moe(args) if index in args.sparse_layers else super().make_mlp(args, index)

    @classmethod
    def make_moe(cls, a: MoeArgs) -> SparseMoE:
        return SparseMoE(routing=a.routing, hidden_size=a.hidden_size)

    def shard_mlp(self, layer: nn.Module, prefix: str, tp: TensorParallel, plan: ShardPlan) -> None:
        if isinstance(layer.mlp, SparseMoE):
            shard_experts(layer.mlp, prefix, tp, plan)
        else:
            super().shard_mlp(layer, prefix, tp, plan)


def shared_mlp(a: MoeArgs) -> LlamaMLP | None:
    """The gated MLP of routing.shared_expert_size beside the experts (a shared expert, with the decoder's other
    options), or None where the routing has none."""
    assert a.routing is not None
    if not a.routing.shared_expert_size:
        return None
    fields = {name: getattr(a, name) for name in LlamaArgs.__dataclass_fields__}
    return LlamaMLP(LlamaArgs(**{**fields, "intermediate_size": a.routing.shared_expert_size}))
