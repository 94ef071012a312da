"""GLM-4.5 / 4.6 / 4.7 and GLM-4.5-Air (Glm4MoeForCausalLM): a Llama-attention decoder (qkv bias, optional q/k
norm per head, rotary on the first half of each head) whose layers from `first_k_dense_replace` on are DeepSeek-style
mixtures of experts: a sigmoid router with a choice-only correction bias, grouped top-k (noaux_tc), a routed scaling
factor and ungated shared experts beside the routed ones (engine/model/layers/moe.py).
"""

from __future__ import annotations

import re

from engine.errors import UnsupportedModel
from engine.model.layers.moe import SparseMoE
from engine.model.layers.rotary import rope_parameters
from engine.model.layers.routing import read_grouped_routing
from engine.model.models.moe_base import MoeArgs, MoeForCausalLM, shared_mlp

# transformers' Glm4MoeConfig defaults for keys a config.json may leave out.
PARTIAL_ROTARY_FACTOR = 0.5
FIRST_K_DENSE_REPLACE = 1
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class Glm4MoeForCausalLM(MoeForCausalLM):
    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> MoeArgs:
        if config.get("hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"hidden_act {config['hidden_act']!r} is not supported", param="model")
        routing = read_grouped_routing(config, scoring="sigmoid", topk_method="noaux_tc", norm_topk_prob=True)
        rope = rope_parameters(config)
        rope.setdefault("partial_rotary_factor", PARTIAL_ROTARY_FACTOR)
        first_sparse = config.get("first_k_dense_replace", FIRST_K_DENSE_REPLACE)
        return MoeArgs.from_config(
            {**config, "rope_parameters": rope},
            names,
            qk_norm=bool(config.get("use_qk_norm")),
            partial_rotary=True,
            routing=routing,
            sparse_layers=tuple(range(first_sparse, config["num_hidden_layers"])),
        )

    @classmethod
    def make_moe(cls, a: MoeArgs) -> SparseMoE:
        return SparseMoE(routing=a.routing, hidden_size=a.hidden_size, shared_experts=shared_mlp(a))

    def checkpoint_name(self, name: str) -> str | None:
        """The hub checkpoints' next-n prediction layers (num_nextn_predict_layers of them, stored as
        model.layers.{num_hidden_layers + i}: a decoder layer with eh_proj, enorm, hnorm and a shared head) are not
        read here: speculative method mtp reads the first as its head (engine/model/models/next_n_mtp.py)."""
        layer = _LAYER.match(name)
        return None if layer is not None and int(layer.group(1)) >= self.args.num_layers else name
