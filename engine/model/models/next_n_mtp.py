"""The next-n prediction (multi-token-prediction) layer that DeepSeek-V3 / R1, GLM-4.5 / 4.6 / 4.7 and GLM-4.7-Flash
checkpoints ship after the decoder's layers (model.layers.{num_hidden_layers}.*): one more decoder layer that guesses
the token after next.

At position p it takes the embedding of token p+1 through `enorm` and the target's final hidden state of p (after the
model's last norm, as vLLM and SGLang feed it) through `hnorm`, concatenated in that order (embedding first) and
projected back to the hidden size by `eh_proj`; then one decoder layer of the family (its attention and, where the
checkpoint's layer has them, its experts), `shared_head.norm` and `shared_head.head`. Its own next step is fed its
output row before that norm (the residual stream, as vLLM carries it). The embedding and the head are the layer's own
where the checkpoint stores them, else the target's; the rotary tables are the target's. Of num_nextn_predict_layers
only the first is read: it makes every guess.

The head runs on the engine's ModelRunner as engine/model/models/mtp_base.py says.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.attention.base import AttentionBackend
from engine.errors import StartupError
from engine.model.kv_spec import KVGroupSpec, latent_group
from engine.model.layers.mla import mla_softmax_scale
from engine.model.layers.norm import RMSNorm
from engine.model.models.deepseek_v2 import DeepseekDecoderLayer, DeepseekV2ForCausalLM, make_moe
from engine.model.models.glm4_moe import Glm4MoeForCausalLM
from engine.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
from engine.model.models.mtp_base import MtpHeadBase

MARKER = "eh_proj.weight"  # the tensor that says a checkpoint ships the layer


def next_n_prefix(num_layers: int) -> str:
    """Where the hub's checkpoints store the first next-n layer: after the decoder's num_hidden_layers layers."""
    return f"model.layers.{num_layers}."


class SharedHead(nn.Module):
    """The layer's final norm and, where the checkpoint stores one, its own lm_head."""

    def __init__(self, hidden_size: int, eps: float, vocab_size: int | None) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False) if vocab_size else None


class NextNHead(MtpHeadBase):
    """enorm, hnorm, eh_proj, the decoder layer (`layer`), shared_head and maybe embed_tokens (the hub's names less
    model.layers.{n}.); `target` is the model whose rotary, and embedding or lm_head where the layer has none, it
    shares. A family's subclass builds its layer and runs it (decode(): the layer's output plus its residual)."""

    def __init__(self, *, args: Any, target: Any, experts: bool, own_embed: bool, own_head: bool) -> None:
        super().__init__(args, target)
        h, eps = args.hidden_size, args.rms_norm_eps
        self.prefix = next_n_prefix(args.num_layers)
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layer = self.make_layer(args, type(target), experts)
        self.shared_head = SharedHead(h, eps, args.vocab_size if own_head else None)
        self.embed_tokens = (
            nn.Embedding(args.vocab_size, h, _weight=torch.empty(args.vocab_size, h)) if own_embed else None
        )

    @classmethod
    def make_layer(cls, args: Any, family: Any, experts: bool) -> nn.Module:
        raise NotImplementedError

    def kv_groups(self, config: dict) -> list[KVGroupSpec]:
        raise NotImplementedError

    def checkpoint_name(self, name: str) -> str | None:
        if not name.startswith(self.prefix):
            return None
        rest = name.removeprefix(self.prefix)
        return (
            rest
            if rest.startswith(("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens."))
            else f"layer.{rest}"
        )

    def share_kernels(self) -> None:
        """Once loaded: the target's kernel choices (FlashInfer's norm, activation and RoPE on CUDA in half precision)
        for the layer's modules, which the target's init_rotary() never saw."""
        target = self._target[0]
        for module in self.modules():
            if isinstance(module, (RMSNorm, LlamaMLP)):
                module.fused = target.fused_kernels
            elif isinstance(module, LlamaAttention):
                module.cos_sin_cache = target.rotary.cos_sin_cache

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) if self.embed_tokens is None else self.embed_tokens(input_ids)

    def join(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(features)], dim=-1))

    def compute_logits(self, hidden: torch.Tensor, exact_rows: torch.Tensor | None = None) -> torch.Tensor:
        x = self.shared_head.norm(hidden)
        if self.shared_head.head is None:
            return super().compute_logits(x, exact_rows)
        return self.shared_head.head(x).float()


class DeepseekNextN(NextNHead):
    """DeepSeek-V3 / R1 and GLM-4.7-Flash: an MLA layer over latent pages of its own."""

    @classmethod
    def make_layer(cls, args: Any, family: Any, experts: bool) -> nn.Module:
        return DeepseekDecoderLayer(args, make_moe(args) if experts else LlamaMLP(args))

    def decode(
        self, x: torch.Tensor, positions: torch.Tensor, caches: tuple[torch.Tensor, torch.Tensor], b: AttentionBackend
    ) -> torch.Tensor:
        h, residual = self.layer(x, None, self._target[0].rotary.lookup(positions), caches, b)
        return h + residual

    def kv_groups(self, config: dict) -> list[KVGroupSpec]:
        mla = self.args.mla
        return [latent_group(1, mla.latent, mla_softmax_scale(mla.qk_head_dim, self.args.rope))]


class Glm4MoeNextN(NextNHead):
    """GLM-4.5 / 4.6 / 4.7: a Llama-attention layer (partial rotary) over K/V pages of its own."""

    @classmethod
    def make_layer(cls, args: Any, family: Any, experts: bool) -> nn.Module:
        mlp = family.make_moe(args) if experts else LlamaMLP(args)
        return LlamaDecoderLayer(args, family.make_attention(args, args.num_layers), mlp)  # the hub's layer index

    def decode(
        self, x: torch.Tensor, positions: torch.Tensor, caches: tuple[torch.Tensor, torch.Tensor], b: AttentionBackend
    ) -> torch.Tensor:
        rotary = self._target[0].rotary
        cos, sin = (None, None) if rotary.cos is None else rotary.lookup(positions)
        h, residual = self.layer(x, None, positions, cos, sin, *caches, b)
        return h + residual

    def kv_groups(self, config: dict) -> list[KVGroupSpec]:
        return [KVGroupSpec(layers=(0,), num_kv_heads=self.args.num_kv_heads, head_dim=self.args.head_dim)]


def next_n_head(target: Any, names: set[str]) -> NextNHead:
    """The target's next-n head, built (on the current device) from its checkpoint's tensor `names`; StartupError in
    one line for a family that has none the engine runs, or a checkpoint without the layer."""
    if isinstance(target, DeepseekV2ForCausalLM):
        kind: type[NextNHead] = DeepseekNextN
    elif isinstance(target, Glm4MoeForCausalLM):
        kind = Glm4MoeNextN
    else:
        raise StartupError(
            f"speculative method mtp needs the multi-token-prediction head that Qwen3.5, Qwen3-Next, DeepSeek-V3 and "
            f"GLM-4.5 checkpoints ship; a {type(target).__name__} checkpoint has none",
            param="speculative.method",
        )
    prefix = next_n_prefix(target.args.num_layers)
    if prefix + MARKER not in names:
        raise StartupError(
            f"speculative method mtp needs the next-n prediction layer ({prefix}{MARKER}) that DeepSeek-V3 and "
            f"GLM-4.5 checkpoints ship; this checkpoint has none",
            param="speculative.method",
        )
    experts = any(n.startswith(f"{prefix}mlp.experts.") or n == f"{prefix}mlp.gate.weight" for n in names)
    if experts and target.args.routing is None:
        raise StartupError("the model's next-n layer has experts but the model has none", param="speculative.method")
    return kind(
        args=target.args,
        target=target,
        experts=experts,
        own_embed=f"{prefix}embed_tokens.weight" in names,
        own_head=f"{prefix}shared_head.head.weight" in names,
    )
