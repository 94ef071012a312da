"""Recurrent state beside the KV pages: the state pool (tensors, the runner's), its slot allocator and the snapshots
the prefix cache keeps at page boundaries (bookkeeping, the KV manager's).

A hybrid model's linear-attention layers (Gated DeltaNet) hold, per sequence, a fixed-size state in a slot
instead of pages. A sequence takes a slot when it first runs and gives it back when it finishes or is preempted
(it is recomputed on resume, like its pages); a fork copies its parent's. Pages alone cannot make a prefix hit:
the state after the prefix is needed too, so at the last page boundary a step crosses, a copy of the state goes
into a snapshot slot registered under that page's chained hash. A later sequence whose pages hit up to such a
boundary starts from a copy of the snapshot; without one, the hit stops at the last boundary that has one.
Snapshots are an LRU, evicted when their slots are wanted. Every slot copy (zeroing a fresh slot from the
pool's zero slot, a snapshot into a sequence's slot, a fork) is queued here and applied by the runner before
the step, in order.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from engine.model.layers.recurrent_step import RecurrentSpec

# Slots past the ones handed out: the zero slot (num_slots), which fresh slots are copied from, and the scratch slot
# (num_slots + 1), which a CUDA graph's padding rows read and write and nothing else ever reads.
EXTRA_SLOTS = 2


class StatePool:
    """Every recurrent layer's slots, allocated once: conv windows [layers, slots + 2, conv_dim, K - 1] in the
    model dtype, delta-rule states [layers, slots + 2, Hv, Dk + 1, Dv] in float32 (delta_rule.materialise); slot
    num_slots stays zero, slot num_slots + 1 is scratch."""

    def __init__(self, spec: RecurrentSpec, num_slots: int, dtype: torch.dtype, device: torch.device | str) -> None:
        n, layers = num_slots + EXTRA_SLOTS, len(spec.layers)
        self.num_slots = num_slots
        self.scratch = num_slots + 1
        self.conv = torch.zeros((layers, n, *spec.conv_shape), dtype=dtype, device=device)
        self.delta = torch.zeros((layers, n, *spec.state_shape), dtype=torch.float32, device=device)
        self.layer_states = [(self.conv[i], self.delta[i]) for i in range(layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.delta))

    def copy_slots(self, copies: list[tuple[int, int]]) -> None:
        """src -> dst in every layer, one copy after the other (a later copy may read what an earlier wrote)."""
        for src, dst in copies:
            self.conv[:, dst] = self.conv[:, src]
            self.delta[:, dst] = self.delta[:, src]


class StateSlots:
    """Slot ids of the state pool: num_seqs for sequences, as many again for snapshots (which sequences may
    borrow: a beam step forks before its dropped beams give their slots back); slot num_slots is the zero slot."""

    def __init__(self, num_seqs: int, enable_prefix_caching: bool = True) -> None:
        self.num_seqs = num_seqs
        self.num_slots = 2 * num_seqs
        self.zero = self.num_slots
        self.enable_prefix_caching = enable_prefix_caching
        self._free_seq = list(range(num_seqs - 1, -1, -1))
        self._free_snap = list(range(self.num_slots - 1, num_seqs - 1, -1))
        self._snapshots: OrderedDict[bytes, int] = OrderedDict()  # page hash -> slot, least recently used first
        self.copies: list[tuple[int, int]] = []  # (src, dst) for the runner, before the next step

    def take(self, source: int | None = None) -> int:
        """A slot for a sequence, filled from `source` (a snapshot or a parent's slot; None: zeros)."""
        slot: int | None
        if self._free_seq:
            slot = self._free_seq.pop()
        else:
            slot = self._snapshot_slot()
            if slot is None:
                raise MemoryError("no recurrent-state slot left for a sequence")
        self.copies.append((self.zero if source is None else source, slot))
        return slot

    def take_snapshot(self) -> int | None:
        """A slot for a snapshot about to be captured (None: prefix caching is off, or every slot is held)."""
        return self._snapshot_slot() if self.enable_prefix_caching else None

    def _snapshot_slot(self) -> int | None:
        if self._free_snap:
            return self._free_snap.pop()
        if self._snapshots:
            return self._snapshots.popitem(last=False)[1]
        return None

    def release(self, slot: int) -> None:
        (self._free_seq if slot < self.num_seqs else self._free_snap).append(slot)

    def register(self, h: bytes, slot: int) -> None:
        """The captured state after the page hashed `h`; a snapshot already there wins (this slot is released)."""
        if h in self._snapshots:
            self.release(slot)
        else:
            self._snapshots[h] = slot

    def drop(self, h: bytes) -> None:
        slot = self._snapshots.pop(h, None)
        if slot is not None:
            self.release(slot)

    def find(self, h: bytes) -> int | None:
        """The snapshot after the page hashed `h` (marked recently used), or None."""
        slot = self._snapshots.get(h)
        if slot is not None:
            self._snapshots.move_to_end(h)
        return slot

    def drain(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies

    def check(self, held: list[int]) -> None:
        """Every slot is free, a snapshot or held by exactly one sequence (tests call this every step)."""
        every = self._free_seq + self._free_snap + list(self._snapshots.values()) + held
        assert sorted(every) == list(range(self.num_slots)), sorted(every)


def state_slots_for_budget(spec: RecurrentSpec, dtype: torch.dtype, budget: int, max_num_seqs: int) -> int:
    """The sequences the state pool holds: max_num_seqs, or fewer when their slots (twice as many, snapshots
    included) would take more than half of the cache budget."""
    per_seq = 2 * spec.slot_bytes(dtype)
    return max(1, min(max_num_seqs, budget // 2 // per_seq))
