"""Gemma 4's MoE block (enable_moe_block, the 26B-A4B model): every layer runs its dense GeGLU MLP and, beside it,
top-k of `num_experts` GeGLU experts; each output gets its own RMSNorm and their sum goes through the layer's
post-feedforward norm (the decoder layer in gemma4.py wires it).

The router reads the residual stream itself (not the pre-feedforward norm's output): a weightless RMSNorm, a learned
scale times hidden_size**-0.5, scores over the experts, a float32 softmax, the top k renormalised to sum to 1, and
each chosen weight times its expert's `per_expert_scale`. Experts load from transformers' fused tensors
(experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) or from one tensor per expert and projection.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.errors import UnsupportedModel
from engine.model.layers.activation import gelu_tanh_and_mul
from engine.model.layers.moe import StackedExperts
from engine.model.layers.norm import GemmaRMSNorm
from engine.model.layers.routing import Routing, ScoreLinear, softmax_top_k

MOE_KEYS = ("num_experts", "top_k_experts", "moe_intermediate_size")
# The block's norms, named as the hub names them: the dense output's, the experts' input's and their output's.
MOE_NORMS = ("post_feedforward_layernorm_1", "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2")


def read_routing(config: dict) -> Routing | None:
    """The experts of a Gemma 4 text config (None without enable_moe_block); UnsupportedModel in one line naming
    the key when a count is missing or out of range."""
    if not config.get("enable_moe_block"):
        return None
    values = {key: config.get(key) for key in MOE_KEYS}
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise UnsupportedModel(f"enable_moe_block needs a positive integer {key} (got {value!r})", param="model")
    num_experts, top_k, width = values.values()
    if top_k > num_experts:
        raise UnsupportedModel(f"top_k_experts={top_k} must be in 1..{num_experts} (num_experts)", param="model")
    return Routing(num_experts=num_experts, top_k=top_k, intermediate_size=width, norm_topk_prob=True)


class Gemma4Router(nn.Module):
    """Picks each token's experts and their weights (parameter names as the hub's `router.*`)."""

    def __init__(self, hidden_size: int, routing: Routing, eps: float) -> None:
        super().__init__()
        self.top_k = routing.top_k
        self.norm = GemmaRMSNorm(hidden_size, eps, scaled=False)
        self.scale = nn.Parameter(torch.empty(hidden_size))
        self.root_size = hidden_size**-0.5
        self.proj = ScoreLinear(hidden_size, routing.num_experts)
        self.per_expert_scale = nn.Parameter(torch.empty(routing.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (expert ids [T, k], weights [T, k] in x's dtype)."""
        ids, weights = softmax_top_k(self.proj(self.norm(x) * self.scale * self.root_size), self.top_k, True)
        return ids, (weights * self.per_expert_scale[ids]).to(x.dtype)


def moe_modules(
    hidden_size: int, routing: Routing | None, eps: float
) -> tuple[Gemma4Router | None, StackedExperts | None]:
    """A decoder layer's (router, experts): GeGLU experts as the dense MLP's activation; (None, None) without
    routing."""
    if routing is None:
        return None, None
    experts = StackedExperts(
        num_experts=routing.num_experts,
        hidden_size=hidden_size,
        intermediate_size=routing.intermediate_size,
        activation=gelu_tanh_and_mul,
    )
    return Gemma4Router(hidden_size, routing, eps), experts
