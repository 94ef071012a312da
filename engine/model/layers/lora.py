"""Batched LoRA: every adapter's A and B stacked per projection, applied in one step to the rows of each adapter.

Each wrapped projection holds [adapters, width, in] A and [adapters, width, out] B buffers, where an adapter's
targets within a fused projection (q|k|v, gate|up) sit side by side along `width`; B places each target's
rows at its shard of the fused output, with the scale folded in. A step's rows are grouped per adapter once
(LoraPlan.update), so the step pays two small matmuls per projection for each distinct adapter in it,
whatever the batch size. Rows with no adapter cost nothing.

On a tensor-parallel rank each adapter is checked against the whole model and then cut as its base layers are
(ShardPlan.lora_part): a column-parallel projection's B by its output rows, a row-parallel one's A by its input
columns, whose partial delta joins the base's partial sum before the block's all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.errors import InvalidRequest, UnsupportedModel
from engine.model.adapters import check_adapter, read_adapter

if TYPE_CHECKING:
    from engine.model.sharding import ShardPlan

# Where each PEFT target lives in a decoder layer: (sub-module, shard of a fused projection or None).
TARGET_MODULES = {
    "q_proj": ("self_attn", "qkv_proj"),
    "k_proj": ("self_attn", "qkv_proj"),
    "v_proj": ("self_attn", "qkv_proj"),
    "o_proj": ("self_attn", "o_proj"),
    "gate_proj": ("mlp", "gate_up_proj"),
    "up_proj": ("mlp", "gate_up_proj"),
    "down_proj": ("mlp", "down_proj"),
}


class LoraPlan:
    """The current step's rows per adapter slot: a slice when they are one run, else an index tensor."""

    def __init__(self) -> None:
        self.groups: list[tuple[int, slice | torch.Tensor]] = []
        self.runs: list[tuple[int | None, int]] = []  # the last update's (the other tensor-parallel ranks get them)

    def update(self, runs: list[tuple[int | None, int]], device: torch.device) -> None:
        """runs: (adapter slot or None, number of rows), in row order."""
        self.runs = runs
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
            (slot, slice(spans[0].start, spans[0].stop))
            if len(spans) == 1
            else (slot, torch.tensor([r for span in spans for r in span], device=device))
            for slot, spans in ranges.items()
        ]


class LoraLinear(nn.Module):
    """A projection plus the LoRA deltas of the step's adapters: y = base(x) + (x A^T) B for each group's rows."""

    def __init__(
        self, *, base: nn.Module, shards: dict[str, tuple[int, int]], num_slots: int, max_rank: int, plan: LoraPlan
    ) -> None:
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

    def clear(self, slot: int) -> None:
        """Empties the slot for another adapter."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.widths[slot] = 0

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


@dataclass
class LoadedAdapter:
    """An adapter read from its folder and checked against the model: ready to be written into a slot."""

    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, target) -> (A, B), float32
    folder: str  # where it was read (every other tensor-parallel rank reads its own part there)


class LoraSet:
    """The loaded adapters: their slots by name, the plan every LoraLinear of the model reads, and (when adapters
    load at run time) the free slots and a key per load that tells two loads under one name apart."""

    def __init__(
        self,
        *,
        num_slots: int,
        max_rank: int,
        shapes: dict[str, tuple[int, int]],
        num_layers: int,
        shard: ShardPlan | None = None,
    ) -> None:
        # shapes: each target's (out, in) on the whole model; shard: this rank's part of it (None: all of it)
        self.num_slots, self.max_rank, self.shapes, self.num_layers = num_slots, max_rank, shapes, num_layers
        self.shard = shard
        self.slots: dict[str, int] = {}
        self.ranks: dict[str, int] = {}
        self.keys: dict[str, str] = {}  # name -> what its prefix-cache hashes are seeded with
        self.plan = LoraPlan()
        self.wrapped: dict[tuple[int, str, str], LoraLinear] = {}
        self._loads = count(1)

    def read(self, name: str, folder: Path) -> LoadedAdapter:
        """The adapter in `folder`, checked against this model and MAX_LORA_RANK; UnsupportedModel in one line.
        Reads files only (no slot is touched), so it may run on any thread."""
        try:
            info = check_adapter(Path(folder), self.shapes, self.num_layers)
            if info.rank > self.max_rank:
                raise UnsupportedModel(f"rank {info.rank}, above MAX_LORA_RANK={self.max_rank}", param="model")
            weights = read_adapter(Path(folder), info)
            if self.shard is not None:  # checked whole, held in part
                weights = {
                    (layer, target): self.shard.lora_part(_weight_name(layer, target), a, b)
                    for (layer, target), (a, b) in weights.items()
                }
        except UnsupportedModel as exc:
            raise UnsupportedModel(f"adapter {name!r}: {exc.message}", param="model") from None
        return LoadedAdapter(info.rank, info.scale, weights, str(folder))

    def install(self, name: str, adapter: LoadedAdapter, busy: set[int]) -> int:
        """Writes the adapter into a slot no name holds and no running request (`busy`) still reads; its slot."""
        if name in self.slots:
            raise InvalidRequest(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        free = [s for s in range(self.num_slots) if s not in self.slots.values() and s not in busy]
        if not free:
            raise UnsupportedModel(
                f"all {self.num_slots} LoRA slots are taken (MAX_LORAS): unload an adapter first", param="lora_name"
            )
        slot = free[0]
        self.write(slot, adapter)
        self.slots[name], self.ranks[name] = slot, adapter.rank
        # A name loaded again (other weights, maybe) must not meet the KV pages its earlier load left cached.
        self.keys[name] = f"{name}#{next(self._loads)}" if name in self.keys else name
        return slot

    def write(self, slot: int, adapter: LoadedAdapter) -> None:
        """Empties the slot and writes the adapter's weights into it (another tensor-parallel rank's install: rank
        0 picked the slot)."""
        for linear in self.wrapped.values():
            linear.clear(slot)
        for (layer, target), (a, b) in adapter.weights.items():
            module_name, proj = TARGET_MODULES[target]
            self.wrapped[(layer, module_name, proj)].set(slot, target, a, b, adapter.scale)

    def remove(self, name: str) -> None:
        """Forgets the name; its slot is reused once the requests still running with it are done."""
        if name not in self.slots:
            raise InvalidRequest(f"The lora adapter '{name}' cannot be found.", param="lora_name")
        del self.slots[name], self.ranks[name]


def attach_lora(
    model: nn.Module, adapters: dict[str, str], max_loras: int, max_rank: int, runtime: bool = False
) -> LoraSet:
    """Wraps the projections adapters target in LoraLinears and loads the adapters into their slots; with
    `runtime`, every projection an adapter may target gets all max_loras slots of max_rank now, so that adapters
    loaded later need no new buffers.

    Runs on the loaded float weights, before any int4 or CPU packing swaps the base linears inside the wrappers.
    A tensor-parallel shard (model.shard_plan) checks adapters against the whole model's shapes and holds its part.
    """
    if len(adapters) > max_loras:
        raise UnsupportedModel(
            f"{len(adapters)} adapters are baked but MAX_LORAS is {max_loras}: raise MAX_LORAS", param="model"
        )
    layers = model.model.layers
    shard = getattr(model, "shard_plan", None)
    shapes = target_shapes(model) if shard is None else shard.lora_shapes
    lora = LoraSet(
        num_slots=max_loras if runtime else len(adapters),
        max_rank=max_rank,
        shapes=shapes,
        num_layers=len(layers),
        shard=shard,
    )
    loaded = {name: lora.read(name, Path(folder)) for name, folder in adapters.items()}
    model.lora = lora
    width = max_rank if runtime else max((a.rank for a in loaded.values()), default=1)
    wanted = (
        {(layer, target) for layer in range(len(layers)) for target in shapes}
        if runtime
        else {where for adapter in loaded.values() for where in adapter.weights}
    )
    for layer, target in sorted(wanted):
        module_name, proj = TARGET_MODULES[target]
        parent = getattr(layers[layer], module_name)
        key = (layer, module_name, proj)
        if key not in lora.wrapped:
            lora.wrapped[key] = LoraLinear(
                base=getattr(parent, proj),
                shards=_shards(getattr(parent, proj), target),
                num_slots=lora.num_slots,
                max_rank=width,
                plan=lora.plan,
            )
            setattr(parent, proj, lora.wrapped[key])
    for name, adapter in loaded.items():
        lora.install(name, adapter, set())
    return lora


def target_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection an adapter may target: those every layer has (an MoE model's MLPs are experts,
    with no LoRA there)."""
    layers = model.model.layers
    return {
        t: _shape(getattr(getattr(layers[0], m), p), t)
        for t, (m, p) in TARGET_MODULES.items()
        if all(hasattr(getattr(layer, m, None), p) for layer in layers)
    }


def _weight_name(layer: int, target: str) -> str:
    """Our parameter name of the weight a PEFT target adapts (a fused projection's part keeps its hub name)."""
    return f"model.layers.{layer}.{TARGET_MODULES[target][0]}.{target}.weight"


def _shards(linear: nn.Module, target: str) -> dict[str, tuple[int, int]]:
    offsets = getattr(linear, "shard_offsets", None)  # a FusedLinear, or the serving form of a quantized one
    if offsets is not None:
        return offsets
    return {target: (0, linear.out_features)}


def _shape(linear: nn.Module, target: str) -> tuple[int, int]:
    _, size = _shards(linear, target)[target]
    return size, linear.in_features
