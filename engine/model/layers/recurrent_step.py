"""One step's plan for the recurrent-state layers (Gated DeltaNet, Mamba2), the counterpart of an attention backend's
plan: which rows of the flattened batch are each sequence's, which state slot each sequence reads and writes, and
where a snapshot of a sequence's state is taken (at a page boundary, for the prefix cache). RecurrentStep.run sends
a layer's rows to its decode or prefill rule by that plan.

The runner builds it once per step (engine/core/model_runner.py) from the slots the KV manager gave out; every
recurrent layer runs with it over its own slots of the state pool (engine/core/kv/state_cache.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# Re-runs a verified sequence's first n rows from its state (and fills a capture (rows, slot) within them).
Replay = Callable[[int, "tuple[int, int] | None"], None]
# A layer's rules over some rows of the flattened batch (a slice of its per-token inputs). decode(rows, slot_index,
# slots): one token of each of the sequences at slot_index (a long tensor on the device), their slots also as Python
# ints where the step has them (None in a step a CUDA graph replays); the rule writes the slots. prefill(rows, slot,
# capture, write): one sequence's rows from its state in `slot`; capture (rows, dst): dst gets the state after that
# many rows; write False: the slot keeps the state it had.
Decode = Callable[[slice, torch.Tensor, "list[int] | None"], torch.Tensor]
Prefill = Callable[[slice, int, "tuple[int, int] | None", bool], torch.Tensor]


@dataclass(frozen=True)
class RecurrentSpec:
    """The model's recurrent layers (model layer indices, ascending) and one slot's state shapes per layer:
    the conv window [conv_dim, K - 1] (in the model dtype) and the recurrent state in float32: Gated DeltaNet's
    [Hv, Dk + 1, Dv] (as engine.model.layers.delta_rule.step_ keeps it) or Mamba2's [H, P, N]. `kind` names the
    layer ("gated_deltanet" or "mamba2"), for the start-up log."""

    layers: tuple[int, ...]
    conv_shape: tuple[int, int]
    state_shape: tuple[int, int, int]
    kind: str = "gated_deltanet"

    def slot_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one sequence's state across every recurrent layer."""
        conv = self.conv_shape[0] * self.conv_shape[1] * torch.empty((), dtype=dtype).element_size()
        state = self.state_shape[0] * self.state_shape[1] * self.state_shape[2] * 4
        return len(self.layers) * (conv + state)

    @property
    def label(self) -> str:
        return f"recurrent:{self.kind}:{len(self.layers)}x"


@dataclass(kw_only=True)
class RecurrentStep:
    """spans[i] = (first row, rows) of scheduled sequence i in the flattened batch; slots[i] its state slot (also as
    slot_index, a long tensor on the device); captures: (i, rows into its span, slot) where a copy of sequence i's
    state after that many of its rows goes; is_decode: every sequence has one row (the batched path); indexed: a
    CUDA graph's decode step, whose layers may read slot_index alone (a static buffer the graph runner fills before
    each replay; spans and slots are empty, captures are taken outside the graph); verify: the sequences whose rows
    are a speculative verify (their slots are written by settle(), not by the forward)."""

    spans: list[tuple[int, int]]
    slots: list[int]
    captures: list[tuple[int, int, int]]
    slot_index: torch.Tensor
    is_decode: bool
    indexed: bool = False
    verify: frozenset[int] = frozenset()
    pending: list[tuple[int, Replay]] = field(default_factory=list)  # (sequence, its replay), one per layer

    @classmethod
    def graphed(cls, slot_index: torch.Tensor) -> RecurrentStep:
        """The decode step a CUDA graph captures over `slot_index` (one slot per row, padding rows included)."""
        return cls(spans=[], slots=[], captures=[], slot_index=slot_index, is_decode=True, indexed=True)

    def capture_of(self, i: int) -> tuple[int, int] | None:
        """(rows, slot) of sequence i's snapshot this step, or None."""
        return next(((rows, slot) for j, rows, slot in self.captures if j == i), None)

    def run(
        self, *, decode: Decode, prefill: Prefill, empty: Callable[[], torch.Tensor], pools: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        """A recurrent layer over this step; returns its rules' output rows. A decode step runs every row at once,
        then copies each captured row's slot in `pools` (its snapshot is its state after the step). Otherwise each
        sequence runs on its own, into empty() (the output buffer): a verify's rows from its state, left as it was
        (settle() replays the accepted rows into the slot), a lone row as a decode, more rows as a prefill."""
        if self.is_decode:
            out = decode(slice(None), self.slot_index, None if self.indexed else self.slots)
            for i, _, dst in self.captures:
                for pool in pools:
                    pool[dst].copy_(pool[self.slots[i]])
            return out
        out = empty()
        for i, ((start, length), slot) in enumerate(zip(self.spans, self.slots, strict=True)):
            rows = slice(start, start + length)
            capture = self.capture_of(i)
            if i in self.verify:
                out[rows] = prefill(rows, slot, None, False)
                self.pending.append((i, _replay(prefill, start, slot)))
            elif length == 1 and capture is None:
                out[rows] = decode(rows, torch.tensor([slot], device=out.device), [slot])
            else:
                out[rows] = prefill(rows, slot, capture, True)
        return out


class RecurrentPlan:
    """What the runner hands every recurrent layer in place of an attention backend: planned once per step."""

    def __init__(self) -> None:
        self.step: RecurrentStep | None = None

    def plan(self, step: RecurrentStep) -> None:
        self.step = step

    def settle(self, accepted: dict[int, int]) -> None:
        """accepted[i]: the rows of verified sequence i that were kept; each layer replays them into its slot."""
        step = self.step
        if step is None:
            return
        for i, replay in step.pending:
            n = accepted.get(i, 0)
            if n > 0:
                capture = step.capture_of(i)
                replay(n, capture if capture is not None and capture[0] <= n else None)
        step.pending.clear()


def _replay(prefill: Prefill, start: int, slot: int) -> Replay:
    """Advances `slot` by the first n rows of a verify from `start` (its accepted ones), with a capture within them."""

    def replay(n: int, capture: tuple[int, int] | None) -> None:
        prefill(slice(start, start + n), slot, capture, True)

    return replay
