"""Gemma 3's text model: Gemma 2's config layout (gemma2.py) with q/k norms, five local layers to one global, and a
rope per layer type (local rope_local_base_freq, global rope_theta with its scaling). A Gemma3ForConditionalGeneration
checkpoint serves its language model alone: its vision tower and projector are left unread.
"""

from __future__ import annotations

from engine.model.models.gemma2 import Gemma2ForCausalLM
from engine.model.models.gemma_args import FULL, SLIDING, GemmaArgs, default_layer_types
from engine.model.models.gemma_base import GemmaTextOfMultimodal

# transformers' Gemma3TextConfig defaults: a multimodal checkpoint's text_config lists only what differs from them.
TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096, "tie_word_embeddings": True,
    "final_logit_softcapping": None, "attn_logit_softcapping": None,
}
GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 10_000.0


def gemma3_ropes(config: dict) -> dict[str, dict]:
    """Each layer type's rope parameters as transformers 5 reads them: `rope_parameters` keyed by layer type, or
    the older rope_theta (global) + rope_local_base_freq (local) + rope_scaling (global only)."""
    given = config.get("rope_parameters") or {}
    if given and not all(isinstance(v, dict) for v in given.values()):
        given = {FULL: dict(given)}  # one set of parameters: the global layers' (the local ones keep theta 10k)
    ropes = {t: dict(given.get(t) or {"rope_type": "default"}) for t in (SLIDING, FULL)}
    scaling = dict(config.get("rope_scaling") or {})
    if "type" in scaling:
        scaling["rope_type"] = scaling.pop("type")
    ropes[FULL].update(scaling)
    ropes[FULL].setdefault("rope_theta", config.get("rope_theta") or GLOBAL_THETA)
    ropes[SLIDING].setdefault("rope_theta", config.get("rope_local_base_freq") or LOCAL_THETA)
    return ropes


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text (model_type gemma3_text)."""

    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> GemmaArgs:
        config = {**TEXT_DEFAULTS, **config}
        layer_types = default_layer_types(config, int(config.get("sliding_window_pattern") or 6))
        return cls.args_from(config, layer_types, gemma3_ropes(config), qk_norm=True)


class Gemma3ForConditionalGeneration(GemmaTextOfMultimodal, Gemma3ForCausalLM):
    """A Gemma 3 image-text checkpoint served as its text model (text in, text out): transformers 5's
    model.language_model.* and 4.x's language_model.model.* are ours; the vision tower and the projector are not
    read."""

    TEXT_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                     "language_model.lm_head.weight": "lm_head.weight"}
    NOT_TEXT = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")
