"""Phi-3.5-MoE (PhimoeForCausalLM): the Llama decoder with LayerNorm (weight and bias) in RMSNorm's places, biases
on q, k, v, o and the lm_head, and every MLP a mixture of 16 experts routed by sparsemixer (two experts a token,
engine/model/layers/routing.py). Its LongRoPE carries its own scales (short_mscale, long_mscale); the hub's names
are Mixtral's (block_sparse_moe, w1 / w2 / w3).

NOTE: transformers' Phimoe rotary computes its frequencies from the short factors at every length (only the scale
follows the length); served past original_max_position_embeddings, the long factors run here, as in vLLM and in
the release's own modelling code.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from engine.errors import UnsupportedModel
from engine.model.layers.norm import LayerNorm
from engine.model.layers.routing import SPARSEMIXER
from engine.model.models.llama import LlamaArgs
from engine.model.models.mixtral import MixtralForCausalLM
from engine.model.models.moe_base import MoeArgs, read_moe_args
from engine.model.models.phi3 import phi_rope


class PhimoeForCausalLM(MixtralForCausalLM):
    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> MoeArgs:
        if config.get("num_experts_per_tok", 2) != 2:
            raise UnsupportedModel(
                f"num_experts_per_tok={config['num_experts_per_tok']} (sparsemixer routes to two experts)",
                param="model",
            )
        args = read_moe_args(config, names, expert_size_key="intermediate_size", norm_topk_prob=False)
        assert args.routing is not None
        jitter = float(config.get("router_jitter_noise", 0.01))
        args.routing = dataclasses.replace(args.routing, scoring=SPARSEMIXER, jitter_eps=jitter)
        args.rope = phi_rope(config)
        return args

    @classmethod
    def make_layer(cls, args: LlamaArgs, index: int) -> nn.Module:
        layer = super().make_layer(args, index)
        layer.input_layernorm = LayerNorm(args.hidden_size, args.rms_norm_eps)
        layer.post_attention_layernorm = LayerNorm(args.hidden_size, args.rms_norm_eps)
        return layer

    def __init__(self, args: MoeArgs, head_vocab: int | None = None) -> None:
        super().__init__(args, head_vocab)
        self.model.norm = LayerNorm(args.hidden_size, args.rms_norm_eps)
