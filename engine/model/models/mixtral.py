"""Mixtral: the Llama decoder (with Mistral's sliding window when the config sets one) whose every MLP is a
mixture of experts routed by a softmax over the chosen k. Hub checkpoints name the MoE `block_sparse_moe` and
its experts' projections w1 (gate), w3 (up) and w2 (down); transformers 5's fused layout uses `mlp.experts.*`.
"""

from __future__ import annotations

import re

from engine.model.models.moe_base import MoeArgs, MoeForCausalLM, read_moe_args

_EXPERT_W = re.compile(r"\.experts\.(\d+)\.w([123])\.")
_W_NAMES = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


class MixtralForCausalLM(MoeForCausalLM):
    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> MoeArgs:
        return read_moe_args(config, names, expert_size_key="intermediate_size", norm_topk_prob=True)

    def checkpoint_name(self, name: str) -> str:
        """Hub names -> ours: block_sparse_moe.experts.{i}.w1 -> mlp.experts.{i}.gate_proj, and so on."""
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return _EXPERT_W.sub(lambda m: f".experts.{m.group(1)}.{_W_NAMES[m.group(2)]}.", name)
