"""The multi-token-prediction head that Qwen3.5 and Qwen3-Next checkpoints ship (mtp.*): one more decoder layer that
guesses the token after next.

At position p it takes the embedding of token p+1 and the target's final hidden state of position p (after the
model's last norm, as vLLM and SGLang feed it), each through its own zero-centred RMSNorm, concatenated in that
order (embedding first) and projected back to the hidden size by `fc`; then one full-attention decoder layer of the
family (gated attention, the family's MLP or experts), its own final norm, and the target's lm_head. Its own next
step is fed its normed output row in place of the target's hidden state. The embedding, the lm_head and the rotary
tables are the target's.

The head runs on the engine's ModelRunner as engine/model/models/mtp_base.py says; its `carry` is the normed output.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from engine.attention.base import AttentionBackend
from engine.model.kv_spec import KVGroupSpec
from engine.model.layers.norm import GemmaRMSNorm
from engine.model.models.mtp_base import MtpHeadBase
from engine.model.models.qwen3_5 import HybridArgs, HybridDecoderLayer

PREFIX = "mtp."


def has_experts(names: set[str]) -> bool:
    """The checkpoint's MTP layer runs experts (mtp.layers.0.mlp.gate / .experts), not a dense MLP."""
    return any(n.startswith(f"{PREFIX}layers.0.mlp.experts") or n == f"{PREFIX}layers.0.mlp.gate.weight" for n in names)


def head_args(args: HybridArgs, experts: bool) -> HybridArgs:
    """The target's shape for one full-attention layer (sparse when the checkpoint's MTP layer has experts)."""
    return replace(args, num_layers=1, layer_types=("full_attention",), sparse_layers=(0,) if experts else ())


class MtpHead(MtpHeadBase):
    """mtp.fc, mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.layers.0, mtp.norm (the hub's names, less
    `mtp.`); `target` is the Qwen3.5 / Qwen3-Next model whose embedding, lm_head and rotary it shares."""

    def __init__(self, args: HybridArgs, target: nn.Module) -> None:
        super().__init__(args, target)
        h, eps = args.hidden_size, args.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = GemmaRMSNorm(h, eps)
        self.pre_fc_norm_hidden = GemmaRMSNorm(h, eps)
        self.layers = nn.ModuleList([HybridDecoderLayer(args, 0)])  # its experts where args.sparse_layers is (0,)
        self.norm = GemmaRMSNorm(h, eps)

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        return name.removeprefix(PREFIX) if name.startswith(PREFIX) else None

    def kv_groups(self, config: dict) -> list[KVGroupSpec]:
        return [KVGroupSpec(layers=(0,), num_kv_heads=self.args.num_kv_heads, head_dim=self.args.head_dim)]

    def join(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(features)], dim=-1))

    def decode(
        self, x: torch.Tensor, positions: torch.Tensor, caches: tuple[torch.Tensor, torch.Tensor], b: AttentionBackend
    ) -> torch.Tensor:
        cos, sin = self._target[0].rotary.lookup(positions)
        return self.norm(self.layers[0](x, cos, sin, caches, b))
