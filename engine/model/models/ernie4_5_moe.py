"""ERNIE 4.5 MoE (Ernie4_5_MoeForCausalLM: ERNIE-4.5-21B-A3B, 300B-A47B): ERNIE 4.5's decoder (interleaved rotary
pairs) whose layers from moe_layer_start_index to moe_layer_end_index, every moe_layer_interval-th, are mixtures of
experts: softmax scores, the choice made on the scores plus a correction bias (moe_statics), the chosen scores
renormalised as weights; moe_num_shared_experts experts' width of ungated shared MLP beside them.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from engine.model.layers.moe import SparseMoE
from engine.model.layers.routing import BiasedChoiceRouter, read_grouped_routing
from engine.model.models.llama import LlamaForCausalLM
from engine.model.models.moe_base import MoeArgs, MoeForCausalLM, shared_mlp


class ErnieRouter(BiasedChoiceRouter):
    """The DeepSeek-style router with ERNIE's correction bias, stored [1, E] (one group of experts)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features)
        self.e_score_correction_bias = nn.Parameter(torch.empty(1, out_features, dtype=torch.float32))


def ernie_sparse_layers(config: dict) -> tuple[int, ...]:
    num_layers = config["num_hidden_layers"]
    start, end = config.get("moe_layer_start_index", 1), config.get("moe_layer_end_index", -1)
    end, interval = num_layers - 1 if end in (None, -1) else end, config.get("moe_layer_interval") or 1
    return tuple(i for i in range(num_layers) if (i + 1) % interval == 0 and (start or 0) <= i <= end)


class Ernie4_5_MoeForCausalLM(MoeForCausalLM):
    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> MoeArgs:
        deepseek_keys = {  # ERNIE's names (moe_num_experts, moe_k) for what read_grouped_routing reads
            "n_routed_experts": config.get("moe_num_experts") or config.get("num_experts"),
            "num_experts_per_tok": config.get("moe_k") or config.get("num_experts_per_tok"),
            "n_shared_experts": config.get("moe_num_shared_experts") or 0,
            "norm_topk_prob": True,
        }
        routing = read_grouped_routing(
            {**config, **deepseek_keys}, scoring="softmax", topk_method="noaux_tc", norm_topk_prob=True
        )
        args = LlamaForCausalLM.read_args(config, names)  # the Llama decoder's: ERNIE's rotary, its biases
        fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
        return MoeArgs(**fields, routing=routing, sparse_layers=ernie_sparse_layers(config))

    @classmethod
    def make_moe(cls, a: MoeArgs) -> SparseMoE:
        assert a.routing is not None
        gate = ErnieRouter(a.hidden_size, a.routing.num_experts)
        return SparseMoE(routing=a.routing, hidden_size=a.hidden_size, shared_experts=shared_mlp(a), gate=gate)

    def checkpoint_name(self, name: str) -> str:
        """moe_statics' correction bias (transformers 5: under mlp.gate; the hub: beside it) -> the router's."""
        return name.replace(".mlp.gate.moe_statics.", ".mlp.gate.").replace(".mlp.moe_statics.", ".mlp.gate.")
