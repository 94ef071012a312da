"""Architecture registry: the `architectures` name in config.json -> the family that runs it (one file each).

A family is an nn.Module class that satisfies CausalLM below; the loader asks it to read its config, builds it on
the meta device, and fills it from the checkpoint (engine/model/checkpoint.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol

from engine.errors import UnsupportedModel

if TYPE_CHECKING:
    import torch
    from torch import nn

    from engine.attention.base import AttentionBackend, AttentionMetadata
    from engine.model.kv_spec import KVGroupSpec

# Architecture name -> (module, class). Only the family a checkpoint names is imported (model_class), so a
# worker's cold start does not pay for every family's module; callers that only ask which names are supported
# (membership, sorted names) read the keys.
ARCHITECTURES: dict[str, tuple[str, str]] = {
    # Bidirectional encoders: embeddings only (bert.py, modernbert.py, nomic_bert.py)
    "BertModel": ("engine.model.models.bert", "BertModel"),
    "RobertaModel": ("engine.model.models.bert", "BertModel"),
    "XLMRobertaModel": ("engine.model.models.bert", "BertModel"),
    "ModernBertModel": ("engine.model.models.modernbert", "ModernBertModel"),
    "NomicBertModel": ("engine.model.models.nomic_bert", "NomicBertModel"),
    # Their cross-encoders: the encoder and its classification head (scores)
    "BertForSequenceClassification": ("engine.model.models.bert", "BertModel"),
    "RobertaForSequenceClassification": ("engine.model.models.bert", "BertModel"),
    "XLMRobertaForSequenceClassification": ("engine.model.models.bert", "BertModel"),
    "ModernBertForSequenceClassification": ("engine.model.models.modernbert", "ModernBertModel"),
    "DeepseekV2ForCausalLM": ("engine.model.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("engine.model.models.deepseek_v2", "DeepseekV3ForCausalLM"),
    "Ernie4_5ForCausalLM": ("engine.model.models.llama", "LlamaForCausalLM"),
    "Ernie4_5_MoeForCausalLM": ("engine.model.models.ernie4_5_moe", "Ernie4_5_MoeForCausalLM"),
    "Exaone4ForCausalLM": ("engine.model.models.olmo2", "Exaone4ForCausalLM"),
    "FalconH1ForCausalLM": ("engine.model.models.falcon_h1", "FalconH1ForCausalLM"),
    "Gemma2ForCausalLM": ("engine.model.models.gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("engine.model.models.gemma3", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("engine.model.models.gemma3", "Gemma3ForConditionalGeneration"),
    "Gemma4ForCausalLM": ("engine.model.models.gemma4", "Gemma4ForCausalLM"),
    "Gemma4ForConditionalGeneration": ("engine.model.models.gemma4_multimodal", "Gemma4ForConditionalGeneration"),
    "Glm4MoeLiteForCausalLM": ("engine.model.models.deepseek_v2", "Glm4MoeLiteForCausalLM"),
    "Glm4MoeForCausalLM": ("engine.model.models.glm4_moe", "Glm4MoeForCausalLM"),
    "GraniteForCausalLM": ("engine.model.models.granite", "GraniteForCausalLM"),
    "GraniteMoeForCausalLM": ("engine.model.models.granite", "GraniteMoeForCausalLM"),
    "GraniteMoeSharedForCausalLM": ("engine.model.models.granite", "GraniteMoeForCausalLM"),
    "GraniteMoeHybridForCausalLM": ("engine.model.models.granitemoehybrid", "GraniteMoeHybridForCausalLM"),
    "GptOssForCausalLM": ("engine.model.models.gpt_oss", "GptOssForCausalLM"),
    "LlamaForCausalLM": ("engine.model.models.llama", "LlamaForCausalLM"),
    # Cross-encoders: the decoder plus a score head (engine/model/classifier.py attaches it)
    "LlamaForSequenceClassification": ("engine.model.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("engine.model.models.llama", "LlamaForCausalLM"),
    "Ministral3ForCausalLM": ("engine.model.models.llama", "LlamaForCausalLM"),
    "Mistral3ForConditionalGeneration": ("engine.model.models.mistral3", "Mistral3ForConditionalGeneration"),
    "MixtralForCausalLM": ("engine.model.models.mixtral", "MixtralForCausalLM"),
    "NemotronHForCausalLM": ("engine.model.models.nemotron_h", "NemotronHForCausalLM"),
    "Olmo2ForCausalLM": ("engine.model.models.olmo2", "Olmo2ForCausalLM"),
    "Olmo3ForCausalLM": ("engine.model.models.olmo2", "Olmo2ForCausalLM"),
    "OlmoeForCausalLM": ("engine.model.models.olmoe", "OlmoeForCausalLM"),
    "Phi3ForCausalLM": ("engine.model.models.phi3", "Phi3ForCausalLM"),
    "PhimoeForCausalLM": ("engine.model.models.phimoe", "PhimoeForCausalLM"),
    "Qwen2ForCausalLM": ("engine.model.models.llama", "LlamaForCausalLM"),
    "Qwen2MoeForCausalLM": ("engine.model.models.qwen3_moe", "Qwen2MoeForCausalLM"),
    "Qwen3ForCausalLM": ("engine.model.models.llama", "LlamaForCausalLM"),
    "Qwen3ForSequenceClassification": ("engine.model.models.llama", "LlamaForCausalLM"),
    "Qwen3MoeForCausalLM": ("engine.model.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "Qwen3NextForCausalLM": ("engine.model.models.qwen3_5", "Qwen3NextForCausalLM"),
    "Qwen2_5_VLForConditionalGeneration": ("engine.model.models.qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Qwen3VLForConditionalGeneration": ("engine.model.models.qwen3_vl", "Qwen3VLForConditionalGeneration"),
    "Qwen3VLMoeForConditionalGeneration": ("engine.model.models.qwen3_vl", "Qwen3VLMoeForConditionalGeneration"),
    "Qwen3_5ForCausalLM": ("engine.model.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5ForConditionalGeneration": ("engine.model.models.qwen3_5", "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForCausalLM": ("engine.model.models.qwen3_5", "Qwen3_5MoeForCausalLM"),
    "Qwen3_5MoeForConditionalGeneration": ("engine.model.models.qwen3_5", "Qwen3_5MoeForConditionalGeneration"),
    "SeedOssForCausalLM": ("engine.model.models.llama", "LlamaForCausalLM"),
    "SmolLM3ForCausalLM": ("engine.model.models.llama", "LlamaForCausalLM"),
}

# Architectures people deploy that the engine knows it cannot run yet -> what is missing, for the one-line refusal
# (a bake fails with it rather than with the list of supported names).
NOT_BUILT: dict[str, str] = {
    "DeepseekV32ForCausalLM": "DeepSeek sparse attention (the lightning indexer: index_n_heads, index_topk)",
    "GlmMoeDsaForCausalLM": "DeepSeek sparse attention (the lightning indexer: index_n_heads, index_topk)",
    "DeepseekV4ForCausalLM": "DeepSeek-V4's compressed sparse attention and hyper-connections (compress_rates)",
}


class CausalLM(Protocol):
    """What the engine asks of a model family.

    `args` carries at least hidden_size, intermediate_size, num_layers, num_q_heads, num_kv_heads, head_dim,
    vocab_size and max_position_embeddings (CUDA start-up sizes its activations from them). A family may also
    define `checkpoint_name(name) -> str | None` to rename hub tensors to its own (None: skip the tensor), and its
    modules `checkpoint_shards(prefix)` to stack several checkpoint tensors into one parameter (an expert: a
    Shard with an index). A module that holds stacked linears (MoE experts) defines `swap_expert_linears(select,
    make)` so that int4 and CPU packing reach them; `args.activation_width`, where present, is the widest MLP
    activation per token (an MoE's k experts) that CUDA start-up budgets for instead of intermediate_size.
    """

    args: Any
    lora: Any  # engine.model.layers.lora.LoraSet once adapters are attached
    fused_kernels: bool

    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> Any:
        """The family's shape from config.json and the checkpoint's tensor names; UnsupportedModel (one line
        naming the config key) for what the family does not run; KeyError for a missing required key."""

    def kv_groups(self, config: dict) -> list[KVGroupSpec]: ...
    def init_rotary(
        self, max_positions: int, dtype: torch.dtype, device: torch.device, fused: bool | None = None
    ) -> None: ...
    def tie_weights(self) -> None: ...
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend | list[AttentionBackend],
    ) -> torch.Tensor: ...
    def compute_logits(self, hidden: torch.Tensor, exact_rows: torch.Tensor | None = None) -> torch.Tensor: ...


def model_class(architecture: str) -> type[nn.Module]:
    """The class that runs `architecture`, or UnsupportedModel naming it."""
    try:
        module, name = ARCHITECTURES[architecture]
    except KeyError:
        refuse_not_built(architecture)
        supported = ", ".join(sorted(ARCHITECTURES))
        raise UnsupportedModel(
            f"architecture {architecture!r} is not supported (supported: {supported})", param="model"
        ) from None
    return getattr(importlib.import_module(module), name)


def refuse_not_built(architecture: str) -> None:
    """UnsupportedModel naming what the engine lacks, for an architecture in NOT_BUILT."""
    if architecture in NOT_BUILT:
        raise UnsupportedModel(
            f"architecture {architecture!r} is not supported yet: {NOT_BUILT[architecture]} is not built",
            param="model",
        )
