"""Qwen3-VL image-text checkpoints: the text model is Qwen3's decoder (q/k norm; Qwen3-MoE's for the MoE) with
multimodal rotary positions and deepstack (the vision tower's features of a few of its blocks added to the image
tokens' hidden states after the decoder's first layers, in LlamaForCausalLM.forward); the tower, the image tokens
and the checkpoint's layout are engine/model/vision/qwen_vl_model.py's."""

from __future__ import annotations

from engine.model.checkpoint import Shard
from engine.model.layers.moe import SparseMoE, StackedExperts
from engine.model.models.llama import LlamaArgs, LlamaForCausalLM
from engine.model.models.moe_base import MoeArgs, MoeForCausalLM, read_moe_args
from engine.model.models.qwen3_moe import qwen_sparse_layers
from engine.model.vision.qwen_vl_model import QwenVisionLM


class Qwen3VLForConditionalGeneration(QwenVisionLM, LlamaForCausalLM):
    @classmethod
    def read_text_args(cls, text: dict, names: set[str]) -> LlamaArgs:
        return LlamaForCausalLM.read_args({**text, "architectures": ["Qwen3ForCausalLM"]}, names)  # q/k norm


class HubLayoutExperts(StackedExperts):
    """Stacked experts read from the hub's fused [E, in, out] tensors or transformers 5's [E, out, in] ones (both
    are published; the tensor's shape says which)."""

    def checkpoint_shards(self, prefix: str) -> dict[str, Shard]:
        return {
            "experts.gate_up_proj": Shard(param=f"{prefix}.gate_up_proj", transposed=None),
            "experts.down_proj": Shard(param=f"{prefix}.down_proj", transposed=None),
        }


class Qwen3VLMoeForConditionalGeneration(QwenVisionLM, MoeForCausalLM):
    @classmethod
    def read_text_args(cls, text: dict, names: set[str]) -> MoeArgs:
        # Qwen3-MoE's decoder whose router always renormalises its top k
        return read_moe_args(
            text,
            names,
            expert_size_key="moe_intermediate_size",
            norm_topk_prob=True,
            sparse_layers=qwen_sparse_layers(text),
            qk_norm=True,
        )

    @classmethod
    def make_moe(cls, a: MoeArgs) -> SparseMoE:
        r = a.routing
        return SparseMoE(
            routing=r,
            hidden_size=a.hidden_size,
            experts=HubLayoutExperts(
                num_experts=r.num_experts, hidden_size=a.hidden_size, intermediate_size=r.intermediate_size
            ),
        )
