"""What every bidirectional encoder family (bert.py, modernbert.py, nomic_bert.py) shares: it embeds or scores and
never samples, so it has no vocabulary head, no LoRA slot and no fused decoder kernels, and its KV group exists only
for the scheduler's page bookkeeping; and the renaming of their hub tensor names that they all do (heads, layers)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.model.kv_spec import KVGroupSpec


class EncoderModel(nn.Module):
    """A bidirectional encoder whose final hidden states are pooled into embeddings (or a cross-encoder's scores)."""

    encoder = True

    def __init__(self, args: Any) -> None:
        super().__init__()
        self.args = args
        self.lora = None
        self.fused_kernels = False
        self.lm_head = None  # no vocabulary head: the loader finds none to keep

    def kv_groups(self, config: dict) -> list[KVGroupSpec]:
        # NOTE: the scheduler counts a prompt's tokens in pages; the smallest group (one layer, one KV head) keeps
        # that bookkeeping while the pages, never written, take next to no memory.
        return [KVGroupSpec(layers=(0,), num_kv_heads=1, head_dim=self.args.head_dim)]

    def init_rotary(
        self, max_positions: int, dtype: torch.dtype, device: torch.device, fused: bool | None = None
    ) -> None:
        pass  # absolute position embeddings: no rotary tables (the rotary families build theirs)

    def tie_weights(self) -> None:
        pass  # no vocabulary head to tie

    def compute_logits(self, hidden: torch.Tensor, exact_rows: torch.Tensor | None = None) -> torch.Tensor:
        raise RuntimeError("an encoder has no vocabulary head: it embeds or scores and never samples")


def head_name(name: str, heads: dict[str, str]) -> str | None:
    """A head's hub tensor name under ours: the first of `heads`' hub prefixes it starts with, replaced; None when
    it is no head's."""
    hub = next((prefix for prefix in heads if name.startswith(prefix)), None)
    return None if hub is None else heads[hub] + name.removeprefix(hub)


def layer_name(name: str, prefix: str, modules: dict[str, str]) -> str | None:
    """`<prefix>N.<module>.<param>` as `layers.N.<ours>.<param>` for a module of `modules` (hub -> ours); None for
    any other name."""
    if not name.startswith(prefix):
        return None
    index, rest = name.removeprefix(prefix).split(".", 1)
    module, param = rest.rsplit(".", 1)
    return f"layers.{index}.{modules[module]}.{param}" if module in modules else None
