"""Mistral3ForConditionalGeneration (Mistral Small 3.1 / 3.2, Devstral Small 2, Magistral with images): the text
model is the Llama family's (text_config: mistral, or ministral3 with its query scaling), the vision tower Pixtral's
(engine/model/vision/pixtral.py) and the projector Mistral 3's (pixtral_projector.py). An image becomes rows of
image tokens, one per merged patch, each row closed by a break token and the last by an end token; the image's
features replace the image tokens' embeddings only, and every token takes a 1-D position. Checkpoints come in
transformers 5's layout (model.language_model.*, model.vision_tower.*, model.multi_modal_projector.*, lm_head) or
4's (language_model.model.*, language_model.lm_head, vision_tower.*, multi_modal_projector.*)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import UnsupportedModel
from engine.model.models.llama import LlamaArgs, LlamaForCausalLM
from engine.model.vision.pixtral import PixtralVisionArgs, PixtralVisionTower
from engine.model.vision.pixtral_projector import Mistral3Projector
from engine.model.vision.spec import BrokenRows, VisionSpec

TEXT_ARCHITECTURES = {"mistral": "MistralForCausalLM", "ministral3": "Ministral3ForCausalLM"}
# checkpoint prefix -> ours, both layouts
PREFIXES = {
    "model.language_model.": "model.",
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "model.vision_tower.": "vision_tower.",
    "model.multi_modal_projector.": "multi_modal_projector.",
}
# Mistral3Config's and PixtralProcessor's defaults (the tokenizer's [IMG], [IMG_BREAK], [IMG_END] in Mistral's
# tekken vocabularies)
IMAGE_TOKEN, BREAK_TOKEN, END_TOKEN = 10, 12, 13


@dataclass(frozen=True, kw_only=True)
class Mistral3Vision:
    """The tower's args, the projector's options and the image layout's tokens (config.json's top level)."""

    tower: PixtralVisionArgs
    feature_layer: int
    merge: int
    projector_act: str
    projector_bias: bool
    image_token_id: int
    break_token_id: int
    end_token_id: int

    @classmethod
    def from_config(cls, config: dict) -> Mistral3Vision:
        layer = config.get("vision_feature_layer", -1)
        if not isinstance(layer, int):
            raise UnsupportedModel(f"vision_feature_layer {layer!r}: only one layer is supported", param="model")
        image = config.get("image_token_index", config.get("image_token_id"))
        return cls(
            tower=PixtralVisionArgs.from_config(config.get("vision_config") or {}),
            feature_layer=layer,
            merge=int(config.get("spatial_merge_size") or 2),
            projector_act=config.get("projector_hidden_act") or "gelu",
            projector_bias=bool(config.get("multimodal_projector_bias")),
            image_token_id=IMAGE_TOKEN if image is None else int(image),
            # (the tokenizer's ids, where the processor names the tokens, win: engine/core/images/intake.py)
            break_token_id=BREAK_TOKEN,
            end_token_id=END_TOKEN,
        )


class Mistral3ForConditionalGeneration(LlamaForCausalLM):
    """The Llama decoder plus vision_tower and multi_modal_projector, rank 0's alone when tensor-parallel."""

    TOWER_MODULES = ("vision_tower", "multi_modal_projector")

    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> LlamaArgs:
        text = dict(config.get("text_config") or {})
        kind = text.get("model_type") or "mistral"
        if kind not in TEXT_ARCHITECTURES:
            raise UnsupportedModel(f"text_config.model_type {kind!r} is not supported (mistral, ministral3)", "model")
        args = super().read_args({**text, "architectures": [TEXT_ARCHITECTURES[kind]]}, names)
        args.vision = Mistral3Vision.from_config(config)
        return args

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__(args)
        v: Mistral3Vision = args.vision
        self.vision_tower = PixtralVisionTower(v.tower, v.feature_layer)
        self.multi_modal_projector = Mistral3Projector(
            vision_hidden=v.tower.hidden_size,
            text_hidden=args.hidden_size,
            merge=v.merge,
            act=v.projector_act,
            bias=v.projector_bias,
            eps=args.rms_norm_eps,
        )

    def checkpoint_name(self, name: str) -> str | None:
        for prefix, ours in PREFIXES.items():
            if name.startswith(prefix):
                name = ours + name[len(prefix) :]
                break
        text = getattr(super(), "checkpoint_name", None)
        return text(name) if text is not None else name

    def vision_spec(self) -> VisionSpec:
        v: Mistral3Vision = self.args.vision
        return VisionSpec(
            image_token_id=v.image_token_id,
            tokens_per_image=None,
            image_size=None,
            rows=BrokenRows(
                patch_size=v.tower.patch_size,
                merge_size=v.merge,
                break_token_id=v.break_token_id,
                end_token_id=v.end_token_id,
            ),
        )

    def encode_images(self, pixels: list[torch.Tensor], grids: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Each image [3, height, width] (grid: its merged patches' rows and columns) -> [rows * columns, hidden]:
        the embeddings of its image tokens, row by row."""
        features = self.vision_tower(pixels)
        merge = self.args.vision.merge
        return self.multi_modal_projector(features, [(r * merge, c * merge) for r, c in grids])
