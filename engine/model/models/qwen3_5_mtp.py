"""The multi-token-prediction head that Qwen3.5 and Qwen3-Next checkpoints ship (mtp.*): one more decoder layer that
guesses the token after next.

At position p it takes the embedding of token p+1 and the target's final hidden state of position p (after the
model's last norm, as vLLM and SGLang feed it), each through its own zero-centred RMSNorm, concatenated in that
order (embedding first) and projected back to the hidden size by `fc`; then one full-attention decoder layer of the
family (gated attention, the family's MLP or experts), its own final norm, and the target's lm_head. Its own next
step is fed its normed output row in place of the target's hidden state. The embedding, the lm_head and the rotary
tables are the target's.

The head runs on the engine's ModelRunner like any model: the caller sets `features` (one row per input token)
before each forward and reads `carry` (the normed output rows) after it.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.model.kv_spec import KVGroupSpec
from engine.model.layers.norm import GemmaRMSNorm
from engine.model.models.qwen3_5 import HybridArgs, HybridDecoderLayer

PREFIX = "mtp."


def has_experts(names: set[str]) -> bool:
    """The checkpoint's MTP layer runs experts (mtp.layers.0.mlp.gate / .experts), not a dense MLP."""
    return any(n.startswith(f"{PREFIX}layers.0.mlp.experts") or n == f"{PREFIX}layers.0.mlp.gate.weight" for n in names)


def head_args(args: HybridArgs, experts: bool) -> HybridArgs:
    """The target's shape for one full-attention layer (sparse when the checkpoint's MTP layer has experts)."""
    return replace(args, num_layers=1, layer_types=("full_attention",), sparse_layers=(0,) if experts else ())


class MtpHead(nn.Module):
    """mtp.fc, mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.layers.0, mtp.norm (the hub's names, less
    `mtp.`); `target` is the Qwen3.5 / Qwen3-Next model whose embedding, lm_head and rotary it shares."""

    def __init__(self, args: HybridArgs, target: nn.Module) -> None:
        super().__init__()
        h, eps = args.hidden_size, args.rms_norm_eps
        self.args = args
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = GemmaRMSNorm(h, eps)
        self.pre_fc_norm_hidden = GemmaRMSNorm(h, eps)
        self.layers = nn.ModuleList([HybridDecoderLayer(args, 0)])  # its experts where args.sparse_layers is (0,)
        self.norm = GemmaRMSNorm(h, eps)
        self._target = (target,)  # a tuple: shared, not a submodule (its weights are the target's to load)
        self.lora = None
        self.features: torch.Tensor | None = None  # set by the caller before each forward: a row per token
        self.carry: torch.Tensor | None = None  # each row's normed output, after a forward

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        return name.removeprefix(PREFIX) if name.startswith(PREFIX) else None

    def kv_groups(self, config: dict) -> list[KVGroupSpec]:
        return [KVGroupSpec(layers=(0,), num_kv_heads=self.args.num_kv_heads, head_dim=self.args.head_dim)]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend | list[AttentionBackend],
    ) -> torch.Tensor:
        assert self.features is not None, "features are set before each forward"
        target = self._target[0]
        cos, sin = target.rotary.lookup(positions)
        embeds = self.pre_fc_norm_embedding(target.model.embed_tokens(input_ids))
        x = self.fc(torch.cat([embeds, self.pre_fc_norm_hidden(self.features.to(embeds.dtype))], dim=-1))
        b = backend[0] if isinstance(backend, list) else backend
        x = self.layers[0](x, cos, sin, kv_caches[0], b)
        self.carry = self.norm(x)
        return self.carry

    def compute_logits(self, hidden: torch.Tensor, exact_rows: torch.Tensor | None = None) -> torch.Tensor:
        return self._target[0].compute_logits(hidden, exact_rows)
