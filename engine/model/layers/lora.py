"""Batched LoRA: every adapter's A and B stacked per projection, applied in one step to the rows of each adapter.

Each wrapped projection holds [adapters, width, in] A and [adapters, width, out] B buffers, where an adapter's
targets within a fused projection (q|k|v, gate|up) sit side by side along `width`; B places each target's
rows at its shard of the fused output, with the scale folded in. A step's rows are grouped per adapter once
(LoraPlan.update), so the step pays two small matmuls per projection for each distinct adapter in it,
whatever the batch size. Rows with no adapter cost nothing.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from engine.errors import UnsupportedModel
from engine.model.adapters import check_adapter, read_adapter

# Where each PEFT target lives in a decoder layer: (sub-module, shard of a fused projection or None).
TARGET_MODULES = {
    "q_proj": ("self_attn", "qkv_proj"), "k_proj": ("self_attn", "qkv_proj"), "v_proj": ("self_attn", "qkv_proj"),
    "o_proj": ("self_attn", "o_proj"), "gate_proj": ("mlp", "gate_up_proj"), "up_proj": ("mlp", "gate_up_proj"),
    "down_proj": ("mlp", "down_proj"),
}


class LoraPlan:
    """The current step's rows per adapter slot: a slice when they are one run, else an index tensor."""

    def __init__(self) -> None:
        self.groups: list[tuple[int, slice | torch.Tensor]] = []

    def update(self, runs: list[tuple[int | None, int]], device: torch.device) -> None:
        """runs: (adapter slot or None, number of rows), in row order."""
        ranges: dict[int, list[range]] = {}
        row = 0
        for slot, n in runs:
            if slot is not None:
                spans = ranges.setdefault(slot, [])
                if spans and spans[-1].stop == row:
                    spans[-1] = range(spans[-1].start, row + n)
                else:
                    spans.append(range(row, row + n))
            row += n
        self.groups = [
            (slot, slice(spans[0].start, spans[0].stop)) if len(spans) == 1
            else (slot, torch.tensor([r for span in spans for r in span], device=device))
            for slot, spans in ranges.items()
        ]


class LoraLinear(nn.Module):
    """A projection plus the LoRA deltas of the step's adapters: y = base(x) + (x A^T) B for each group's rows."""

    def __init__(self, base: nn.Module, shards: dict[str, tuple[int, int]], num_slots: int, max_rank: int,
                 plan: LoraPlan) -> None:
        super().__init__()
        self.base, self.shards, self.plan = base, shards, plan
        # The first float tensor: an int4 base holds packed integer codes and float scales.
        weight = next(t for t in (*base.parameters(), *base.buffers()) if t.is_floating_point())
        width = len(shards) * max_rank
        kw = dict(dtype=weight.dtype, device=weight.device)
        self.register_buffer("lora_a", torch.zeros(num_slots, width, base.in_features, **kw))
        self.register_buffer("lora_b", torch.zeros(num_slots, width, base.out_features, **kw))
        self.widths = [0] * num_slots  # rows of lora_a each slot fills (0: that adapter leaves this projection alone)

    def set(self, slot: int, target: str, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        """Writes one target's A [rank, in] and B [out, rank] (float32) into the slot."""
        start, rank = self.widths[slot], a.shape[0]
        offset, size = self.shards[target]
        self.lora_a[slot, start : start + rank] = a
        self.lora_b[slot, start : start + rank, offset : offset + size] = (b * scale).T
        self.widths[slot] = start + rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for slot, rows in self.plan.groups:
            width = self.widths[slot]
            if not width:
                continue
            a, b = self.lora_a[slot, :width], self.lora_b[slot, :width]
            if isinstance(rows, slice):
                y[rows].add_((x[rows] @ a.T) @ b)
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a.T) @ b)
        return y


class LoraSet:
    """The loaded adapters: their slots by name and the plan every LoraLinear of the model reads."""

    def __init__(self, slots: dict[str, int], ranks: dict[str, int]) -> None:
        self.slots, self.ranks = slots, ranks
        self.plan = LoraPlan()


def attach_lora(model: nn.Module, adapters: dict[str, str], max_loras: int, max_rank: int) -> LoraSet:
    """Wraps every projection some adapter targets in a LoraLinear and loads the adapters into their slots.

    Runs on the loaded float weights, before any int4 or CPU packing swaps the base linears inside the wrappers.
    """
    if len(adapters) > max_loras:
        raise UnsupportedModel(f"{len(adapters)} adapters are baked but MAX_LORAS is {max_loras}: raise MAX_LORAS",
                               param="model")
    layers = model.model.layers
    # Only the projections every layer has (an MoE model's MLPs are experts: no LoRA there).
    shapes = {t: _shape(getattr(getattr(layers[0], m), p), t) for t, (m, p) in TARGET_MODULES.items()
              if all(hasattr(getattr(layer, m), p) for layer in layers)}
    infos, weights = {}, {}
    for name, folder in adapters.items():
        try:
            info = check_adapter(Path(folder), shapes, len(layers))
        except UnsupportedModel as exc:
            raise UnsupportedModel(f"adapter {name!r}: {exc.message}", param="model") from None
        if info.rank > max_rank:
            raise UnsupportedModel(f"adapter {name!r} has rank {info.rank}, above MAX_LORA_RANK={max_rank}",
                                   param="model")
        infos[name], weights[name] = info, read_adapter(Path(folder), info)
    lora = LoraSet({name: i for i, name in enumerate(adapters)}, {n: i.rank for n, i in infos.items()})
    model.lora = lora
    rank = max(lora.ranks.values(), default=1)
    wrapped: dict[tuple[int, str, str], LoraLinear] = {}
    for name, slot in lora.slots.items():
        for (layer, target), (a, b) in weights[name].items():
            module_name, proj = TARGET_MODULES[target]
            parent = getattr(layers[layer], module_name)
            key = (layer, module_name, proj)
            if key not in wrapped:
                wrapped[key] = LoraLinear(getattr(parent, proj), _shards(getattr(parent, proj), target),
                                          len(adapters), rank, lora.plan)
                setattr(parent, proj, wrapped[key])
            wrapped[key].set(slot, target, a, b, infos[name].scale)
    return lora


def _shards(linear: nn.Module, target: str) -> dict[str, tuple[int, int]]:
    offsets = getattr(linear, "shard_offsets", None)  # a FusedLinear, or the serving form of a quantized one
    if offsets is not None:
        return offsets
    return {target: (0, linear.out_features)}


def _shape(linear: nn.Module, target: str) -> tuple[int, int]:
    _, size = _shards(linear, target)[target]
    return size, linear.in_features

