"""Architecture registry: the `architectures` name in config.json -> our model class."""

from __future__ import annotations

from torch import nn

from engine.errors import UnsupportedModel
from engine.model.models.llama import LlamaForCausalLM

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def model_class(architecture: str) -> type[nn.Module]:
    """The class that runs `architecture`, or UnsupportedModel naming it."""
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise UnsupportedModel(
            f"architecture {architecture!r} is not supported (supported: {supported})", param="model"
        ) from None


# The one family we run; becomes a Protocol when a second family arrives.
CausalLM = LlamaForCausalLM
