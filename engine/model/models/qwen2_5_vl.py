"""Qwen2.5-VL image-text checkpoints (3B to 72B, olmOCR-2): the text model is Qwen2's decoder (q/k/v biases, no q/k
norm) with multimodal rotary positions in contiguous sections; the tower is Qwen2.5-VL's windowed one
(engine/model/vision/qwen2_5_vl.py); the image tokens and the checkpoint's layout (transformers 5's
model.language_model.* / model.visual.*, or the hub releases' model.* / visual.* with the text fields at the top of
config.json) are engine/model/vision/qwen_vl_model.py's."""

from __future__ import annotations

from engine.model.models.llama import LlamaArgs, LlamaForCausalLM
from engine.model.vision.qwen2_5_vl import Qwen2_5VisionArgs, Qwen2_5VisionTower
from engine.model.vision.qwen_vl_model import QwenVisionLM


class Qwen2_5_VLForConditionalGeneration(QwenVisionLM, LlamaForCausalLM):
    MROPE_SECTION = (16, 24, 24)  # transformers' Qwen2_5_VLRotaryEmbedding default
    MROPE_INTERLEAVED = False
    TOWER = (Qwen2_5VisionArgs, Qwen2_5VisionTower)

    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> LlamaArgs:
        if not config.get("text_config"):  # the hub releases: the text model's fields at the top level
            text = {k: v for k, v in config.items() if k != "vision_config"}
            config = {**config, "text_config": text}
        return super().read_args(config, names)

    @classmethod
    def read_text_args(cls, text: dict, names: set[str]) -> LlamaArgs:
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if rope.get("type") == "mrope" or rope.get("rope_type") == "mrope":  # the releases' name for default + sections
            rope = {k: v for k, v in rope.items() if k != "type"} | {"rope_type": "default"}
            text = {**text, ("rope_parameters" if text.get("rope_parameters") else "rope_scaling"): rope}
        return LlamaForCausalLM.read_args({**text, "architectures": ["Qwen2ForCausalLM"]}, names)  # qkv bias
