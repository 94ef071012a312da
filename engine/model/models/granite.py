"""IBM Granite 3.x dense (GraniteForCausalLM): the Llama decoder with four scalars. The token embeddings are scaled
by embedding_multiplier, each attention and MLP output by residual_multiplier before it joins the residual stream,
the attention scores by attention_multiplier (in place of 1/sqrt(head_dim)), and the logits divided by
logits_scaling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.kv_spec import KVGroupSpec, kv_groups, layer_windows
from engine.model.models.llama import LlamaArgs, LlamaForCausalLM


@dataclass(kw_only=True)
class GraniteArgs(LlamaArgs):
    attention_multiplier: float | None = None  # the softmax scale (None: 1/sqrt(head_dim))
    logits_scaling: float = 1.0


class GraniteForCausalLM(LlamaForCausalLM):
    args: GraniteArgs

    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> GraniteArgs:
        args = super().read_args(config, names)
        scale = config.get("attention_multiplier")
        return GraniteArgs(
            **{
                **args.__dict__,
                "embedding_multiplier": float(config.get("embedding_multiplier", 1.0)),
                "residual_multiplier": float(config.get("residual_multiplier", 1.0)),
            },
            attention_multiplier=None if scale is None else float(scale),
            logits_scaling=float(config.get("logits_scaling", 1.0)),
        )

    def kv_groups(self, config: dict) -> list[KVGroupSpec]:
        a = self.args
        windows = layer_windows(config, a.num_layers)
        return kv_groups(windows, a.num_kv_heads, a.head_dim, scale=a.attention_multiplier)

    def compute_logits(self, hidden: torch.Tensor, exact_rows: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.head_logits(hidden, exact_rows)
        return logits if self.args.logits_scaling == 1.0 else logits / self.args.logits_scaling
