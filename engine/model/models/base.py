"""What every family's CausalLM shares: its args (DecoderShape, the fields every config gives), the decoder
(`model`), an lm_head that may be tied to the embeddings, the LoRA slot, and one attention backend per layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.attention.base import AttentionBackend
from engine.model.layers.logits import refine_near_max


@dataclass(kw_only=True)
class DecoderShape:
    """The shape of a decoder every transformers config gives; a family's args add their options to it."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int

    @staticmethod
    def read(config: dict, *, max_positions: int) -> dict[str, Any]:
        """These fields from `config` (KeyError on a missing required one); transformers' defaults for the
        rest: KV heads = query heads, head_dim = hidden / heads, eps 1e-6, `max_positions` positions."""
        heads, hidden = config["num_attention_heads"], config["hidden_size"]
        return dict(
            hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_q_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads,
            vocab_size=config["vocab_size"],
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            max_position_embeddings=config.get("max_position_embeddings", max_positions),
        )


class DecoderLM(nn.Module):
    """The parts of a CausalLM (engine.model.models.CausalLM) that do not depend on the family."""

    def __init__(self, args: Any, model: nn.Module, head_vocab: int | None = None, head_bias: bool = False) -> None:
        """head_vocab: the lm_head's rows where they are not the embedding's (an EAGLE-3 head's draft vocabulary);
        head_bias: the lm_head has a bias (Phi-3.5-MoE)."""
        super().__init__()
        self.args = args
        self.model = model
        self.lm_head = nn.Linear(args.hidden_size, head_vocab or args.vocab_size, bias=head_bias)
        self.fused_kernels = False  # FlashInfer's norm / RoPE / activation kernels, where the family has them
        self.lora = None  # engine.model.layers.lora.LoraSet once adapters are attached
        # The lm_head's rows as loaded (kept by the loader before a CPU packing replaces the Linear): where the
        # head runs in bf16 / fp16, the logits near each row's maximum are recomputed from them in float32.
        self.head_weight: torch.Tensor | None = None
        self.tp = None  # engine.model.layers.parallel.TensorParallel of a vocab-parallel lm_head (a shard)

    def tie_weights(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    def compute_logits(self, hidden: torch.Tensor, exact_rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.head_logits(hidden, exact_rows)

    def head_logits(self, hidden: torch.Tensor, exact_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The lm_head's logits in float32; on `exact_rows` (None: all) the argmax is the float32 one
        (engine.model.layers.logits)."""
        logits = self.lm_head(hidden)
        # NOTE: a shard refines its own columns: the float32 argmax is the largest of the ranks' refined maxima.
        logits = (
            logits.float()
            if self.head_weight is None
            else refine_near_max(logits, hidden, self.head_weight, exact_rows, bias=self.lm_head.bias)
        )
        return logits if self.tp is None else self.tp.gather_vocab(logits)

    @staticmethod
    def layer_backends(backend: AttentionBackend | list[AttentionBackend], num_layers: int) -> list[AttentionBackend]:
        """One backend for every layer, or each layer's own (its KV group's, planned for the step)."""
        return backend if isinstance(backend, list) else [backend] * num_layers
