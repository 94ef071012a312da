"""A Gemma4ForConditionalGeneration checkpoint: its text model (gemma4.py, from text_config) and, where config.json has
a vision_config, its vision tower and embedder (engine/model/vision/gemma4_vision.py). An image becomes as many soft
tokens as its pooled patches (the engine widens the template's one image token to them, as Gemma4Processor does);
their embeddings replace the placeholders' (unscaled, as transformers' masked_scatter puts them), and the per-layer
input embeddings read the pad token in their place. With use_bidirectional_attention "vision" an image's tokens see
each other both ways on the sliding-window layers; the global layers stay causal. The audio tower is not read.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from engine.model.models.gemma4 import Gemma4ForCausalLM
from engine.model.models.gemma_args import GemmaArgs
from engine.model.models.gemma_base import GemmaTextOfMultimodal
from engine.model.vision.gemma4_vision import Gemma4VisionArgs, Gemma4VisionEmbedder, Gemma4VisionTower
from engine.model.vision.spec import PooledPatches, VisionSpec

# Gemma4Config's defaults for the tokens config.json may leave out.
TOKENS = {"image_token_id": 258_880, "boi_token_id": 255_999, "eoi_token_id": 258_882}


@dataclass(kw_only=True)
class Gemma4MultimodalArgs(GemmaArgs):
    """The text decoder's args plus the vision tower's (None: the checkpoint has none) and the image tokens."""

    vision: Gemma4VisionArgs | None = None
    image_token_id: int = TOKENS["image_token_id"]
    boi_token_id: int = TOKENS["boi_token_id"]
    eoi_token_id: int = TOKENS["eoi_token_id"]
    pad_token_id: int = 0
    bidirectional_images: bool = False


class Gemma4ForConditionalGeneration(GemmaTextOfMultimodal, Gemma4ForCausalLM):
    """model.language_model.* is the text model, model.vision_tower.* the tower, model.embed_vision.* its embedder."""

    args: Gemma4MultimodalArgs
    TEXT_PREFIXES = {
        "model.language_model.": "model.",
        "model.vision_tower.": "vision_tower.",
        "model.embed_vision.": "embed_vision.",
    }
    NOT_TEXT = ("model.audio_tower.", "model.embed_audio.")
    TOWER_MODULES = ("vision_tower", "embed_vision")  # rank 0's alone when tensor-parallel

    def __init__(self, args: Gemma4MultimodalArgs) -> None:
        super().__init__(args)
        v = args.vision
        if v is not None:
            self.vision_tower = Gemma4VisionTower(v)
            self.embed_vision = Gemma4VisionEmbedder(v.hidden_size, args.hidden_size, v.rms_norm_eps)

    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> Gemma4MultimodalArgs:
        text = super().read_args(config, names)
        raw = config.get("text_config") or {}
        vision = config.get("vision_config")
        tokens = {k: config[k] if config.get(k) is not None else default for k, default in TOKENS.items()}
        return Gemma4MultimodalArgs(
            **{f.name: getattr(text, f.name) for f in fields(text)},
            **tokens,
            vision=None if vision is None else Gemma4VisionArgs.from_config(vision),
            pad_token_id=raw.get("pad_token_id") if raw.get("pad_token_id") is not None else 0,
            bidirectional_images=raw.get("use_bidirectional_attention") == "vision",
        )

    def checkpoint_name(self, name: str) -> str | None:
        if self.args.vision is None and name.startswith(("model.vision_tower.", "model.embed_vision.")):
            return None  # a checkpoint whose config has no vision_config: its text model serves alone
        return super().checkpoint_name(name)

    def vision_spec(self) -> VisionSpec | None:
        a = self.args
        if a.vision is None:
            return None
        return VisionSpec(
            image_token_id=a.image_token_id,
            tokens_per_image=None,
            image_size=None,
            boi_token_id=a.boi_token_id,
            eoi_token_id=a.eoi_token_id,
            bidirectional=a.bidirectional_images,
            pooled=PooledPatches(a.vision.patch_size, a.vision.pooling_kernel_size),
            bidirectional_windowed_only=True,
        )

    def per_layer_inputs(self, input_ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        # transformers looks an image token's per-layer embedding up as the pad token's
        ids = input_ids.masked_fill(input_ids == self.args.image_token_id, self.args.pad_token_id)
        return super().per_layer_inputs(ids, h)

    def encode_images(self, pixels: list[torch.Tensor], grids: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Each image's patches and (rows, columns) -> [soft tokens, hidden]: their embeddings."""
        tokens = self.vision_tower(pixels, grids)
        return list(self.embed_vision(torch.cat(tokens)).split([len(t) for t in tokens]))
