"""Gemma 4's dense text model (gemma4_text; a Gemma4ForConditionalGeneration checkpoint's in gemma4_multimodal.py).

The Gemma decoder (gemma_base.py) configured with: a head size and KV head count of their own on global layers
(own KV groups); keys reused as values on global layers (attention_k_eq_v); q, k and v norms that scale by w, not
1 + w; attention scale 1; proportional rope with a partial rotary factor on global layers; the last
num_kv_shared_layers layers attend over the pages of the last earlier layer of their type and hold none
(KVGroupSpec.readers); per-layer input embeddings (PLE) added after each layer's MLP; a learned per-layer scalar;
the MoE block beside the MLP (enable_moe_block, gemma4_moe.py).
"""

from __future__ import annotations

from engine.errors import UnsupportedModel
from engine.model.models.gemma4_moe import read_routing
from engine.model.models.gemma_args import FULL, SLIDING, GemmaArgs, check_config, default_layer_types
from engine.model.models.gemma_base import GemmaForCausalLM

DEFAULTS = {"max_position_embeddings": 131_072, "sliding_window": 512}
DEFAULT_ROPES = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


def gemma4_args(config: dict) -> GemmaArgs:
    """A Gemma 4 text config -> GemmaArgs; UnsupportedModel in one line for what the engine does not run."""
    encoder = "use_bidirectional_attention 'all'" if config.get("use_bidirectional_attention") == "all" else None
    check_config(config, config.get("hidden_activation"), encoder)
    types = default_layer_types(config, 6)
    types[-1] = FULL  # as transformers forces it
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or 256
    ropes = {t: dict(p) for t, p in (config.get("rope_parameters") or DEFAULT_ROPES).items()}
    return GemmaArgs.from_config(
        {**DEFAULTS, **config},
        types,
        ropes,
        num_layers=len(types),
        head_dim=head_dim,
        attn_scale=1.0,
        unit_offset=False,
        qk_norm=True,
        v_norm=True,
        layer_scalar=True,
        layer_shapes=_layer_shapes(config, types, kv_heads, head_dim),
        k_eq_v=bool(config.get("attention_k_eq_v")),
        kv_sources=_kv_sources(types, config),
        ple_dim=config.get("hidden_size_per_layer_input", 256) or 0,
        ple_vocab=config.get("vocab_size_per_layer_input", 262_144),
        double_wide_mlp=bool(config.get("use_double_wide_mlp")),
        routing=read_routing(config),
    )


def _layer_shapes(config: dict, types: list[str], kv_heads: int, head_dim: int) -> list[tuple[int, int]]:
    """Each layer's (num_kv_heads, head_dim): config.json's per_layer_config when saved, else transformers' rule
    (global layers: global_head_dim, and num_global_key_value_heads with attention_k_eq_v)."""
    per_layer = config.get("per_layer_config")
    if per_layer is None:
        full = {"head_dim": config.get("global_head_dim", 512)}
        if config.get("attention_k_eq_v") and config.get("num_global_key_value_heads"):
            full["num_key_value_heads"] = config["num_global_key_value_heads"]
        per_layer = {i: full for i, t in enumerate(types) if t == FULL}
    per_layer = {int(i): v for i, v in per_layer.items()}
    return [
        (per_layer.get(i, {}).get("num_key_value_heads", kv_heads), per_layer.get(i, {}).get("head_dim", head_dim))
        for i in range(len(types))
    ]


def _kv_sources(types: list[str], config: dict) -> dict[int, int]:
    """Shared-KV layer -> the last layer of its type before the shared ones (transformers' kv_sharing_modes)."""
    first_shared = len(types) - int(config.get("num_kv_shared_layers") or 0)
    if first_shared == len(types):
        return {}
    last = {t: i for i, t in enumerate(types[:first_shared])}
    if first_shared <= 0 or set(last) != set(types):
        raise UnsupportedModel("num_kv_shared_layers leaves a layer type with no layer to share KV from", param="model")
    return {i: last[types[i]] for i in range(first_shared, len(types))}


class Gemma4ForCausalLM(GemmaForCausalLM):
    """The CausalLM of Gemma 4 text (dense, or with the MoE block)."""

    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> GemmaArgs:
        return gemma4_args(config)
