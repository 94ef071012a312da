"""A Qwen image-text checkpoint (Qwen2.5-VL, Qwen3-VL, Qwen3.5; dense and MoE) around its text decoder: text_config
read by the decoder's family, model.language_model.* renamed to model.*, model.visual.* (or the older releases'
visual.*) the vision tower (engine/model/vision/qwen_vl.py, qwen2_5_vl.py: the family's TOWER), the image tokens
from the top of config.json, and multimodal rotary positions (engine/model/layers/mrope.py) with the config's
mrope_section."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.errors import UnsupportedModel
from engine.model.layers.mrope import MultimodalRotary
from engine.model.vision.qwen_vl import QwenVisionArgs, QwenVisionTower
from engine.model.vision.spec import PatchGrid, VisionSpec

if TYPE_CHECKING:
    from engine.model.vision.qwen2_5_vl import Qwen2_5VisionArgs


@dataclass(frozen=True, kw_only=True)
class QwenVision:
    """The vision tower's args, the image tokens and the text rotary's mrope sections."""

    tower: QwenVisionArgs | Qwen2_5VisionArgs
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    mrope_section: tuple[int, ...]

    @classmethod
    def from_config(
        cls, config: dict, section: tuple[int, ...], tower: type[QwenVisionArgs | Qwen2_5VisionArgs]
    ) -> QwenVision:
        """config.json's top level (Qwen3VLConfig's token defaults where it is silent); `section` where the text
        config gives no mrope_section (the family's transformers default); `tower` the family's vision args."""
        text = config.get("text_config") or config  # the older releases keep the text model's fields at the top
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        return cls(
            tower=tower.from_config(config.get("vision_config") or {}),
            image_token_id=config.get("image_token_id", 151655),
            vision_start_token_id=config.get("vision_start_token_id", 151652),
            vision_end_token_id=config.get("vision_end_token_id", 151653),
            mrope_section=tuple(rope.get("mrope_section") or section),
        )


class QwenVisionLM:
    """Mixed in before a Qwen text family's CausalLM, whose args carry `vision` (a QwenVision) and whose forward
    takes image_embeds (rows, [tokens, hidden * (1 + deepstack layers)])."""

    MROPE_SECTION: tuple[int, ...] = (24, 20, 20)  # Qwen3-VL's; Qwen3.5 overrides it
    MROPE_INTERLEAVED = True  # Qwen3-VL's and Qwen3.5's frequencies; Qwen2.5-VL's take contiguous sections
    TOWER: tuple[type, type] = (QwenVisionArgs, QwenVisionTower)  # the family's vision args and tower
    TOWER_MODULES = ("visual",)  # rank 0's alone at tensor_parallel_size > 1 (engine/model/loader.py)
    args: Any

    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> Any:
        # the decoder's options read off its own tensors (Qwen2.5-VL's tower has MLP biases its decoder has not)
        text_names = {n for n in names if not n.startswith(("visual.", "model.visual."))}
        args = cls.read_text_args(dict(config.get("text_config") or {}), text_names)
        args.vision = QwenVision.from_config(config, cls.MROPE_SECTION, cls.TOWER[0])
        if args.vision.tower.out_hidden_size != args.hidden_size:
            raise UnsupportedModel(
                f"vision_config.out_hidden_size {args.vision.tower.out_hidden_size} is not the "
                f"text model's hidden_size {args.hidden_size}",
                param="model",
            )
        return args

    @classmethod
    def read_text_args(cls, text: dict, names: set[str]) -> Any:
        return super().read_args(text, names)

    def __init__(self, args: Any) -> None:
        super().__init__(args)
        self.visual = self.TOWER[1](args.vision.tower)

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith("model.visual."):
            return name.removeprefix("model.")
        if name.startswith("model.language_model."):
            name = "model." + name.removeprefix("model.language_model.")
        text = getattr(super(), "checkpoint_name", None)
        return text(name) if text is not None else name

    def make_rotary(
        self, max_positions: int, dtype: torch.dtype, device: torch.device, fused: bool
    ) -> MultimodalRotary:
        """A multimodal rotary in torch, whatever `fused` says of the family's other kernels: FlashInfer's RoPE
        kernel takes 1-D positions only (the attention layers get no cos|sin table)."""
        a = self.args
        return MultimodalRotary(
            rotary_dim=getattr(a, "rotary_dim", 0) or a.head_dim,
            rope=a.rope,
            section=a.vision.mrope_section,
            interleaved=self.MROPE_INTERLEAVED,
            max_position_embeddings=a.max_position_embeddings,
            max_positions=max_positions,
            dtype=dtype,
            device=device,
        )

    def vision_spec(self) -> VisionSpec:
        v = self.args.vision
        grid = PatchGrid(v.tower.patch_size, v.tower.temporal_patch_size, v.tower.spatial_merge_size)
        return VisionSpec(
            image_token_id=v.image_token_id,
            tokens_per_image=None,
            image_size=None,
            boi_token_id=v.vision_start_token_id,
            eoi_token_id=v.vision_end_token_id,
            grid=grid,
        )

    def encode_images(self, pixels: list[torch.Tensor], grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Each image's patches -> [tokens, hidden * (1 + deepstack layers)]: its tokens' embeddings, then the
        features the decoder's first layers add."""
        return self.visual(pixels, grids)
