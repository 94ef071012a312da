"""What every family's CausalLM shares: its args, the decoder (`model`), an lm_head that may be tied to the
embeddings, the LoRA slot, and one attention backend per layer."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.attention.base import AttentionBackend
from engine.model.layers.logits import refine_near_max


class DecoderLM(nn.Module):
    """The parts of a CausalLM (engine.model.models.CausalLM) that do not depend on the family."""

    def __init__(self, args: Any, model: nn.Module) -> None:
        super().__init__()
        self.args = args
        self.model = model
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.fused_kernels = False  # FlashInfer's norm / RoPE / activation kernels, where the family has them
        self.lora = None  # engine.model.layers.lora.LoraSet once adapters are attached
        # The lm_head's rows as loaded (kept by the loader before a CPU packing replaces the Linear): where the
        # head runs in bf16 / fp16, the logits near each row's maximum are recomputed from them in float32.
        self.head_weight: torch.Tensor | None = None

    def tie_weights(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    def compute_logits(self, hidden: torch.Tensor, exact_rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.head_logits(hidden, exact_rows)

    def head_logits(self, hidden: torch.Tensor, exact_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The lm_head's logits in float32; on `exact_rows` (None: all) the argmax is the float32 one
        (engine.model.layers.logits)."""
        logits = self.lm_head(hidden)
        if self.head_weight is None:
            return logits.float()
        return refine_near_max(logits, hidden, self.head_weight, exact_rows)

    @staticmethod
    def layer_backends(backend: AttentionBackend | list[AttentionBackend], num_layers: int) -> list[AttentionBackend]:
        """One backend for every layer, or each layer's own (its KV group's, planned for the step)."""
        return backend if isinstance(backend, list) else [backend] * num_layers
