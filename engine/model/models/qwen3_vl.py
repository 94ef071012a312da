"""Qwen3-VL image-text checkpoints: the text model is Qwen3's decoder (q/k norm; Qwen3-MoE's for the MoE) with
multimodal rotary positions and deepstack (the vision tower's features of a few of its blocks added to the image
tokens' hidden states after the decoder's first layers, in LlamaForCausalLM.forward); the tower, the image tokens
and the checkpoint's layout are engine/model/vision/qwen_vl_model.py's."""

from __future__ import annotations

from engine.model.models.llama import LlamaArgs, LlamaForCausalLM
from engine.model.vision.qwen_vl_model import QwenVisionLM


class Qwen3VLForConditionalGeneration(QwenVisionLM, LlamaForCausalLM):
    @classmethod
    def read_text_args(cls, text: dict, names: set[str]) -> LlamaArgs:
        return LlamaForCausalLM.read_args({**text, "architectures": ["Qwen3ForCausalLM"]}, names)  # q/k norm
