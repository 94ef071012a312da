"""Gemma 2: the Gemma decoder (gemma_base.py) with (1 + w) norms, one rope for every layer, every other layer
sliding, attention scaled by query_pre_attn_scalar and soft-capped, and a final soft-cap. Its config layout is
the one Gemma 3's text model extends (gemma3.py)."""

from __future__ import annotations

from engine.errors import UnsupportedModel
from engine.model.layers.rotary import rope_parameters
from engine.model.models.gemma_args import FULL, SLIDING, GemmaArgs, check_config, default_layer_types
from engine.model.models.gemma_base import GemmaForCausalLM


class Gemma2ForCausalLM(GemmaForCausalLM):
    """The CausalLM of Gemma 2; Gemma 3's text model differs in its config (read_args) and q/k norms."""

    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> GemmaArgs:
        layer_types = default_layer_types(config, 2)
        rope = rope_parameters(config)
        config = {
            "query_pre_attn_scalar": 256,
            "final_logit_softcapping": 30.0,
            "attn_logit_softcapping": 50.0,
            **config,
        }
        return cls.args_from(config, layer_types, {SLIDING: rope, FULL: rope})

    @staticmethod
    def args_from(config: dict, layer_types: list[str], ropes: dict[str, dict], **fields) -> GemmaArgs:
        """The Gemma 2 / 3 config layout (its defaults filled in) -> GemmaArgs; `fields` sets the rest."""
        check_config(
            config,
            config.get("hidden_activation") or config.get("hidden_act"),
            "use_bidirectional_attention" if config.get("use_bidirectional_attention") else None,
        )
        unknown = set(layer_types) - {SLIDING, FULL}
        if unknown:
            raise UnsupportedModel(f"layer_types {sorted(unknown)} are not supported", param="model")
        scale = float(config["query_pre_attn_scalar"]) ** -0.5
        return GemmaArgs.from_config(
            config,
            layer_types,
            ropes,
            attn_scale=scale,
            attn_soft_cap=config["attn_logit_softcapping"],
            final_soft_cap=config["final_logit_softcapping"],
            **fields,
        )
