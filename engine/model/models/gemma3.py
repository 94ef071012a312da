"""Gemma 3's text model: Gemma 2's config layout (gemma2.py) with q/k norms, five local layers to one global, and a
rope per layer type (local rope_local_base_freq, global rope_theta with its scaling). A Gemma3ForConditionalGeneration
checkpoint adds its SigLIP vision tower and projector (engine/model/vision/): each image becomes mm_tokens_per_image
soft-token embeddings that replace its placeholder tokens' (unscaled, as transformers' masked_scatter puts them), and
an image's tokens attend to each other both ways.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from engine.model.models.gemma2 import Gemma2ForCausalLM
from engine.model.models.gemma_args import FULL, SLIDING, GemmaArgs, default_layer_types
from engine.model.models.gemma_base import GemmaTextOfMultimodal
from engine.model.vision.gemma3_projector import Gemma3Projector
from engine.model.vision.siglip import SiglipArgs, SiglipVisionTower
from engine.model.vision.spec import VisionSpec

# transformers' Gemma3TextConfig defaults: a multimodal checkpoint's text_config lists only what differs from them.
TEXT_DEFAULTS = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "tie_word_embeddings": True,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
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


@dataclass(kw_only=True)
class Gemma3VisionArgs(GemmaArgs):
    """The text decoder's args plus the vision tower's and the image tokens' (config.json's top level)."""

    vision: SiglipArgs = SiglipArgs()
    tokens_per_image: int = 256
    image_token_id: int = 262_144
    boi_token_id: int = 255_999
    eoi_token_id: int = 256_000


class Gemma3ForConditionalGeneration(GemmaTextOfMultimodal, Gemma3ForCausalLM):
    """A Gemma 3 image-text checkpoint: transformers 5's model.language_model.* and 4.x's language_model.model.* are
    the text model; vision_tower.(vision_model.)* the SigLIP tower and multi_modal_projector.* the projector (the
    tower's pooling head, which Gemma 3 does not use, is not read)."""

    args: Gemma3VisionArgs
    TOWER_MODULES = ("vision_tower", "multi_modal_projector")  # rank 0's alone when tensor-parallel
    TEXT_PREFIXES = {
        "model.language_model.": "model.",
        "language_model.model.": "model.",
        "language_model.lm_head.weight": "lm_head.weight",
        "model.vision_tower.vision_model.": "vision_tower.",
        "vision_tower.vision_model.": "vision_tower.",
        "model.vision_tower.": "vision_tower.",
        "model.multi_modal_projector.": "multi_modal_projector.",
    }
    NOT_TEXT = (
        "model.vision_tower.vision_model.head.",
        "vision_tower.vision_model.head.",
        "model.vision_tower.head.",
        "vision_tower.head.",
    )

    def __init__(self, args: Gemma3VisionArgs) -> None:
        super().__init__(args)
        v = args.vision
        self.vision_tower = SiglipVisionTower(v)
        self.multi_modal_projector = Gemma3Projector(
            vision_hidden=v.hidden_size,
            text_hidden=args.hidden_size,
            patches_per_side=v.patches_per_side,
            tokens_per_image=args.tokens_per_image,
            eps=v.layer_norm_eps,
        )

    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> Gemma3VisionArgs:
        text = super().read_args(config, names)
        top = {
            k: config[theirs]
            for k, theirs in (
                ("tokens_per_image", "mm_tokens_per_image"),
                ("image_token_id", "image_token_index"),
                ("boi_token_id", "boi_token_index"),
                ("eoi_token_id", "eoi_token_index"),
            )
            if config.get(theirs) is not None
        }
        return Gemma3VisionArgs(
            **{f.name: getattr(text, f.name) for f in fields(text)},
            vision=SiglipArgs.from_config(config.get("vision_config") or {}),
            **top,
        )

    def vision_spec(self) -> VisionSpec:
        a = self.args
        return VisionSpec(
            image_token_id=a.image_token_id,
            tokens_per_image=a.tokens_per_image,
            image_size=a.vision.image_size,
            boi_token_id=a.boi_token_id,
            eoi_token_id=a.eoi_token_id,
            bidirectional=True,
        )

    def encode_images(self, pixels: list[torch.Tensor], grids: list[None]) -> list[torch.Tensor]:
        """Images of [3, size, size] -> each [tokens_per_image, hidden]: the soft tokens' embeddings (grids: None,
        the tower's square is fixed)."""
        return list(self.multi_modal_projector(self.vision_tower(torch.stack(pixels))))
