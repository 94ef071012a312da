"""The recurrent-state slots of a hybrid model: sequences take zeroed or copied slots, snapshots are an LRU that
gives its slots up to sequences and to newer snapshots, every copy is queued in order, and the pool applies them
in that order; the budget split between the state pool and the pages."""

from __future__ import annotations

import random

import pytest
import torch

from engine.core.kv.state_cache import EXTRA_SLOTS, StatePool, StateSlots, state_slots_for_budget
from engine.model.layers.recurrent_step import RecurrentSpec

SPEC = RecurrentSpec(layers=(0, 2), conv_shape=(6, 3), state_shape=(2, 4, 4))


def test_a_new_slot_is_zeroed_and_a_fork_copies_its_parent():
    slots = StateSlots(2)
    a = slots.take()
    b = slots.take(source=a)
    assert slots.drain() == [(slots.zero, a), (a, b)]
    assert slots.drain() == []
    slots.check([a, b])


def test_snapshots_are_found_by_hash_and_evicted_least_recently_used_first():
    slots = StateSlots(2)
    s1, s2 = slots.take_snapshot(), slots.take_snapshot()
    slots.register(b"h1", s1)
    slots.register(b"h2", s2)
    assert slots.find(b"h1") == s1  # h1 is now the most recently used
    s3 = slots.take_snapshot()  # none free: h2's slot goes
    assert s3 == s2 and slots.find(b"h2") is None and slots.find(b"h1") == s1
    slots.register(b"h1", s3)  # a second snapshot of the same page: the first stays, this slot is freed
    assert slots.find(b"h1") == s1
    slots.check([])


def test_sequences_borrow_snapshot_slots_and_fail_in_one_line_when_none_is_left():
    slots = StateSlots(1)
    held = [slots.take(), slots.take()]  # the second borrows a snapshot slot (a beam forks before others drop)
    assert held[1] >= slots.num_seqs
    with pytest.raises(MemoryError, match="no recurrent-state slot"):
        slots.take()
    for s in held:
        slots.release(s)
    slots.check([])


def test_random_operations_keep_every_slot_accounted_for():
    rng, slots, held, hashes = random.Random(0), StateSlots(4), [], []
    for i in range(2000):
        op = rng.randrange(5)
        if op == 0 and len(held) < 6:
            held.append(slots.take(rng.choice(held) if held and rng.random() < 0.5 else None))
        elif op == 1 and held:
            slots.release(held.pop(rng.randrange(len(held))))
        elif op == 2:
            s = slots.take_snapshot()
            if s is not None:
                hashes.append(str(i).encode())
                slots.register(hashes[-1], s)
        elif op == 3 and hashes:
            slots.drop(rng.choice(hashes))
        elif op == 4 and hashes:
            slots.find(rng.choice(hashes))
        slots.check(held)


def test_the_pool_applies_copies_in_order_in_every_layer():
    pool = StatePool(SPEC, 3, torch.float32, "cpu")
    pool.conv[:, 0], pool.delta[:, 0] = 1.0, 2.0
    pool.copy_slots([(0, 1), (1, 2), (pool.num_slots, 0)])  # 2 reads what 1 just got; 0 is zeroed last
    assert pool.conv[:, 2].eq(1.0).all() and pool.delta[:, 2].eq(2.0).all()
    assert pool.conv[:, 0].eq(0).all() and pool.delta[:, 0].eq(0).all()
    assert pool.nbytes == (3 + EXTRA_SLOTS) * SPEC.slot_bytes(torch.float32)


def test_the_state_takes_at_most_half_the_budget():
    per_seq = SPEC.slot_bytes(torch.bfloat16)
    assert state_slots_for_budget(SPEC, torch.bfloat16, 1 << 30, 64) == 64
    assert state_slots_for_budget(SPEC, torch.bfloat16, 40 * per_seq, 64) == 10  # 2 slots a sequence, half of 40
    assert state_slots_for_budget(SPEC, torch.bfloat16, per_seq, 64) == 1
