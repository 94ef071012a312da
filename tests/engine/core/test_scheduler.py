"""The scheduler on its own: token budget, chunked prefill, decode-first, max_num_seqs, preemption, prefix hits.

A small driver stands in for the model: every sequence that reaches the end of its tokens gets a
token that depends only on the sequence and its length, so schedules can be compared by outcome.
"""

from __future__ import annotations

from itertools import count

from engine.core.kv.manager import KVCacheManager
from engine.core.scheduling.scheduler import Scheduler
from engine.core.scheduling.sequence import Sequence, SequenceGroup
from engine.core.scheduling.step import SchedulerOutput
from engine.model.kv_spec import KVGroupSpec
from engine.sample.params import SamplingParams

_ids = count()


def group(rid: str, prompt: list[int], max_tokens: int, n: int = 1, arrival: int = 0) -> SequenceGroup:
    params = SamplingParams(temperature=0.0 if n == 1 else 1.0, max_tokens=max_tokens, n=n)
    seqs = [
        Sequence(seq_id=next(_ids), token_ids=list(prompt), num_prompt_tokens=len(prompt), index=i) for i in range(n)
    ]
    return SequenceGroup(request_id=rid, prompt_token_ids=list(prompt), params=params, seqs=seqs, arrival=arrival)


def fake_token(seq: Sequence) -> int:
    return (sum(seq.token_ids[: seq.num_prompt_tokens]) * 31 + seq.index * 7 + seq.num_tokens) % 1000


class Driver:
    """Runs schedule -> commit -> append, checking the invariants after every step."""

    def __init__(
        self, num_pages: int, page_size: int = 4, max_num_seqs: int = 8, budget: int = 64, prefix_caching: bool = True
    ) -> None:
        kv = KVCacheManager(
            specs=[KVGroupSpec(layers=(0,), num_kv_heads=1, head_dim=8)],
            num_pages=[num_pages],
            page_size=page_size,
            enable_prefix_caching=prefix_caching,
        )
        self.alloc = kv.allocators[0]
        self.sched = Scheduler(kv=kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
        self.page_size = page_size
        self.steps: list[SchedulerOutput] = []
        self.finished: list[SequenceGroup] = []
        self.failed: list[SequenceGroup] = []

    def add(self, g: SequenceGroup) -> None:
        self.sched.add(g)

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self.failed += [g for g, _ in out.failed]
        assert out.num_tokens <= self.sched.max_num_batched_tokens
        assert sum(g.num_seats for g in self.sched.running) <= self.sched.max_num_seqs
        self.alloc.check()
        for s in out.scheduled:
            needed = -(-(s.start + s.num_tokens) // self.page_size)
            assert len(s.seq.pages) == needed, "pages cover exactly the tokens scheduled"
        self.sched.commit(out)
        forks, finished, done = [], [], []
        for s in out.scheduled:
            if not s.samples:
                continue
            g = s.group
            if not g.forked:  # the engine's own fork: the scheduler gives the choices the lead's pages
                forks += g.fork_choices()
                targets = g.seqs
            else:
                targets = [s.seq]
            for seq in targets:
                seq.append(fake_token(seq), 0.0)
                if len(seq.output_token_ids) == g.params.max_tokens:
                    seq.finish_reason = "length"
                    finished.append(seq)
            if g.finished:
                done.append(g)
        self.sched.postprocess(forks, finished)  # as the engine does after each step
        for g in done:
            self.sched.remove(g)
            self.finished.append(g)
        self.alloc.check()
        self.steps.append(out)
        return out

    def run(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work():
                return
            self.step()
        raise AssertionError("did not finish")


def outputs(groups: list[SequenceGroup]) -> dict[str, list[list[int]]]:
    return {g.request_id: [s.output_token_ids for s in g.seqs] for g in groups}


def test_chunked_prefill_under_budget_with_decode_first():
    d = Driver(num_pages=64, budget=16)
    a = group("a", list(range(1, 7)), max_tokens=12)
    d.add(a)
    d.step()  # a's prompt
    b = group("b", list(range(100, 140)), max_tokens=2)
    d.add(b)
    chunks = []
    while b.seqs[0].num_computed_tokens < 40:
        out = d.step()
        assert out.scheduled[0].group is a and out.scheduled[0].num_tokens == 1  # a's decode goes first
        chunks += [s.num_tokens for s in out.scheduled if s.group is b]
    assert chunks == [15, 15, 10]
    d.run()
    assert {g.request_id for g in d.finished} == {"a", "b"}


def test_max_num_seqs_and_budget_bound_every_step():
    d = Driver(num_pages=64, max_num_seqs=2, budget=8)
    groups = [group(f"r{i}", [i + 1] * (3 + i), max_tokens=4) for i in range(5)]
    for g in groups:
        d.add(g)
    d.run()
    assert max(len({id(s.group) for s in out.scheduled}) for out in d.steps) == 2
    assert all(len(s.output_token_ids) == 4 for g in groups for s in g.seqs)


def test_preemption_by_recompute_gives_the_same_tokens():
    def run(num_pages: int) -> tuple[Driver, dict]:
        d = Driver(num_pages=num_pages, budget=32)
        groups = [group(f"r{i}", [10 * i + j for j in range(8)], max_tokens=12, arrival=i) for i in range(3)]
        for g in groups:
            d.add(g)
        d.run()
        return d, outputs(groups)

    roomy, expected = run(64)
    tight, got = run(10)  # each request needs 5 pages of 4 tokens at its end: 15 > 10
    assert not any(out.preempted for out in roomy.steps)
    preempted = [g.request_id for out in tight.steps for g in out.preempted]
    assert preempted and "r0" not in preempted  # the oldest request is never the victim
    assert got == expected


def test_prefix_cache_hit_skips_cached_pages():
    d = Driver(num_pages=32)
    prompt = list(range(50, 62))  # 3 full pages
    a = group("a", prompt, max_tokens=3)
    d.add(a)
    d.run()
    b = group("b", prompt + [7], max_tokens=3)
    d.add(b)
    out = d.step()
    (s,) = out.scheduled
    assert b.num_cached_tokens == 12 and s.start == 12 and s.num_tokens == 1
    c = group("c", prompt, max_tokens=3)  # a whole-page prompt still runs its last token
    d.add(c)
    out = d.step()
    assert c.num_cached_tokens == 8 and [x.num_tokens for x in out.scheduled if x.group is c] == [4]
    d.run()


def test_prefix_is_shared_between_running_requests():
    d = Driver(num_pages=32)
    prompt = list(range(20, 29))
    a = group("a", prompt, max_tokens=5)
    d.add(a)
    d.step()
    b = group("b", prompt, max_tokens=5)
    d.add(b)
    d.step()
    assert b.seqs[0].pages[:2] == a.seqs[0].pages[:2]
    assert d.alloc.ref_counts[a.seqs[0].pages[0]] == 2
    d.run()
    assert d.alloc.num_free == 32


def test_forked_choices_copy_the_shared_partial_page():
    d = Driver(num_pages=16)
    g = group("g", [1, 2, 3, 4, 5, 6], max_tokens=4, n=2)  # 6 tokens: the second page is partial
    d.add(g)
    d.step()
    first, second = g.seqs
    assert first.pages == second.pages and d.alloc.ref_counts[first.pages[1]] == 2
    out = d.step()
    assert len(out.copies) == 1
    kv_group, src, dst = out.copies[0]
    assert kv_group == 0
    assert src == second.pages[1] and dst == first.pages[1]  # one child copies, the last owner keeps it
    assert first.pages[0] == second.pages[0] and first.pages[1] != second.pages[1]
    d.run()
    assert d.alloc.num_free == 16


def test_request_larger_than_the_pool_fails_alone():
    d = Driver(num_pages=3)
    big = group("big", list(range(1, 11)), max_tokens=8)  # needs 18 tokens, the pool holds 12
    small = group("small", [1, 2], max_tokens=2)
    d.add(big)
    d.add(small)
    d.run()
    assert [g.request_id for g in d.failed] == ["big"]
    assert [g.request_id for g in d.finished] == ["small"]
    assert d.alloc.num_free == 3
