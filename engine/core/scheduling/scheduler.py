"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Each step fills a token budget in priority order: first the groups that decode (one token per live
sequence), then the running prefills (chunked to the budget), then new or preempted requests from the
waiting queue (first come, first served). When pages run out, the most recently admitted group is
preempted by recompute: its pages are freed and it goes back to the front of the queue; the prefix
cache usually gives most of its pages back when it returns.

A prompt's image span (its soft tokens, which attend to each other both ways) is never cut by a chunk's end: the
chunk stops before the span, which runs whole in a later step (a request checks that a span fits in one step's
budget).

Under the "priority" policy the waiting queue is ordered by each request's priority (lower first), then by
arrival, and the running list is kept in that order too, so the group preempted when pages run out is the lowest
priority one admitted last. A waiting group gains one level for every `aging_steps` steps it waits: a request
of priority p behind a stream of priority-q requests (q < p) waits at most (p - q) * aging_steps steps before its
turn comes.
"""

from __future__ import annotations

import bisect
from collections import deque

from engine.core.kv.manager import KVCacheManager
from engine.core.scheduling.sequence import Sequence, SequenceGroup
from engine.core.scheduling.step import ScheduledSeq, SchedulerOutput
from engine.errors import EngineError, InvalidRequest

POLICIES = ("fcfs", "priority")


class Scheduler:
    """Owns the waiting queue and the running list; allocates pages (in every KV layer group, through `kv`) for
    what it schedules. Page needs are per-group counts: a step fits when every group has room."""

    def __init__(
        self,
        *,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "fcfs",
        aging_steps: int = 1000,
    ) -> None:
        if policy not in POLICIES:
            raise InvalidRequest(
                f"scheduling policy {policy!r} is not one of {', '.join(POLICIES)}", param="scheduling_policy"
            )
        self.kv = kv
        self.by_priority, self.aging_steps = policy == "priority", max(1, aging_steps)
        self.page_size = kv.page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.num_preemptions = 0
        self._proposals: dict[int, list[int]] = {}

    def add(self, group: SequenceGroup) -> None:
        self.waiting.append(group)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, group: SequenceGroup) -> None:
        """A finished or aborted group leaves, giving back every page it holds."""
        for seq in group.seqs:
            self.free_seq(seq)
        if group in self.running:
            self.running.remove(group)
        elif group in self.waiting:
            self.waiting.remove(group)

    def postprocess(self, forks: list[tuple[Sequence, Sequence]], finished: list[Sequence]) -> None:
        """After a step: forks take their parents' pages, finished sequences give theirs back.
        NOTE: forks first, since a choice can fork and finish in the same step."""
        for parent, child in forks:
            self.fork(parent, child)
        for seq in finished:
            self.free_seq(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` goes on from `parent`'s computed prefix: it shares every page of every group (a partly filled
        last page is copied when the child first writes into it, see KVCacheManager.allocate)."""
        self.kv.fork(parent, child)

    def free_seq(self, seq: Sequence) -> None:
        self.kv.free(seq)

    def schedule(self, proposals: dict[int, list[int]] | None = None) -> SchedulerOutput:
        """proposals: seq_id -> tokens a proposer guessed (engine/core/spec/); a decoding sequence that has some
        is given room for them and its last token, when that room is free without preempting anyone."""
        self._proposals = proposals or {}
        out = SchedulerOutput()
        if self.by_priority and self.waiting:
            for group in self.waiting:
                group.waited_steps += 1
            self.waiting = deque(sorted(self.waiting, key=self._waiting_key))
        budget = self.max_num_batched_tokens
        taken: set[int] = set()  # ids of groups in this step: they cannot be preempted any more
        for decode in (True, False):
            for group in list(self.running):
                if id(group) in taken or (out.preempted and group in out.preempted):
                    continue
                if all(s.in_decode for s in group.running) != decode:
                    continue
                used = self._schedule_group(group, budget, out, taken, admit=False)
                if used:
                    taken.add(id(group))
                    budget -= used
        self._admit(budget, out, taken)
        if self.kv.state is not None:
            out.state_copies = self.kv.state.drain()
        return out

    def _admit(self, budget: int, out: SchedulerOutput, taken: set[int]) -> None:
        seats = sum(g.num_seats for g in self.running)
        while self.waiting and budget > 0:
            group = self.waiting[0]
            if seats + group.num_seats > self.max_num_seqs and self.running:
                break
            cached = 0
            for seq in group.running:
                if not seq.kv_pages and not group.skips_prefix_cache:
                    self.kv.lookup(seq)
                    cached = cached or seq.num_computed_tokens
            used = self._schedule_group(group, budget, out, taken, admit=True)
            if not used:
                for seq in group.running:
                    self.free_seq(seq)
                if self.running:
                    break
                # Nothing else holds pages or seats: this request can never run.
                self.waiting.popleft()
                out.failed.append((group, self._cannot_fit(group)))
                continue
            if not group.admitted:
                group.admitted = True
                group.num_cached_tokens = min(cached, len(group.prompt_token_ids))
            self.waiting.popleft()
            if self.by_priority:
                bisect.insort(self.running, group, key=_running_key)
            else:
                self.running.append(group)
            taken.add(id(group))
            seats += group.num_seats
            budget -= used

    def _schedule_group(
        self, group: SequenceGroup, budget: int, out: SchedulerOutput, taken: set[int], admit: bool
    ) -> int:
        """Schedules what the group can run now; returns the tokens used (0: nothing fits)."""
        seqs = group.running
        if all(s.in_decode for s in seqs):
            # Decode steps are whole-group: beam search needs every live beam's next token together.
            if len(seqs) > budget:
                return 0
            drafts = self._drafts(seqs, budget, admit)
            need = [
                sum(n)
                for n in zip(*(self.kv.needed(s, 1 + len(d)) for s, d in zip(seqs, drafts, strict=True)), strict=True)
            ]
            if not self._make_room(need, group, out, taken, admit, self._reserve(admit)):
                if not admit:
                    self._give_way(group, out)
                return 0
            for s, d in zip(seqs, drafts, strict=True):
                self.kv.allocate(s, 1 + len(d), out.copies)
                out.scheduled.append(
                    ScheduledSeq(seq=s, group=group, start=s.num_computed_tokens, num_tokens=1 + len(d), draft=d)
                )
            return len(seqs) + sum(len(d) for d in drafts)

        used = 0
        for s in seqs:
            if s is not seqs[0] and not self._share_prompt(group, seqs[0], s):
                continue
            remaining = s.prefill_target - s.num_computed_tokens
            if s.in_decode or remaining <= 0 or used >= budget:
                continue
            n = min(remaining, budget - used)
            full = len(group.prompt_token_ids) // self.page_size * self.page_size
            if s is seqs[0] and len(seqs) > 1 and self.kv.waits_for_choices and s.num_computed_tokens < full:
                # A resumed lead stops at the prompt's full pages, which its choices then take (_share_prompt):
                # past them its sliding windows would drop pages the choices read.
                n = min(n, full - s.num_computed_tokens)
            n = group.whole_images(s.num_computed_tokens, n)
            if n == 0:  # an image's span does not fit in what is left of this step: it waits for a later one
                continue
            need = self.kv.needed(s, n)
            if admit:
                # Admission never preempts and never starts on a shrunken chunk.
                if not self.kv.has_room(need, self._reserve(admit)):
                    break
            elif not self._make_room(need, group, out, taken, admit):
                n = group.whole_images(s.num_computed_tokens, self.kv.fit(s, n))
                if n == 0:
                    if used == 0 and len(self.running) == 1:
                        self._give_way(group, out)
                    break
            self.kv.allocate(s, n, out.copies)
            out.scheduled.append(ScheduledSeq(seq=s, group=group, start=s.num_computed_tokens, num_tokens=n))
            used += n
        return used

    def _drafts(self, seqs: list[Sequence], budget: int, admit: bool) -> list[list[int]]:
        """The proposals the decoding `seqs` run this step: all of theirs when the token budget and the free pages
        hold them (speculation never preempts), else none."""
        drafts = [self._proposals.get(s.seq_id, []) for s in seqs]
        if not any(drafts):
            return drafts
        need = [
            sum(n)
            for n in zip(*(self.kv.needed(s, 1 + len(d)) for s, d in zip(seqs, drafts, strict=True)), strict=True)
        ]
        if len(seqs) + sum(len(d) for d in drafts) > budget or not self.kv.has_room(need, self._reserve(admit)):
            return [[] for _ in seqs]
        return drafts

    def _share_prompt(self, group: SequenceGroup, lead: Sequence, seq: Sequence) -> bool:
        """Whether `seq` may run now. A choice resumed after preemption waits for the lead choice to compute
        the prompt's full pages, then takes them, as its fork first did (the part of them a prefix-cache hit
        gave it is the same pages). With sliding windows the lead waits at those pages for its choices (see
        _schedule_group); should its windows still have dropped some, the choice computes its prompt on its own.

        NOTE: without this, a group of n choices preempted by recompute needed n copies of its prompt when it
        came back, and could fail as too large for a pool it fitted in alone.
        """
        full = len(group.prompt_token_ids) // self.page_size * self.page_size
        if seq.num_computed_tokens >= full:
            return True
        if lead.num_computed_tokens < full:
            return False
        self.kv.share_prefix(lead, seq, full // self.page_size)
        return True

    def _waiting_key(self, group: SequenceGroup) -> tuple[int, int]:
        return group.params.priority - group.waited_steps // self.aging_steps, group.arrival

    def _reserve(self, admit: bool) -> list[int] | None:
        """Free pages an admission must leave in each group for the running decodes (none when nothing runs)."""
        return self.kv.watermark if admit and self.running else None

    def _make_room(
        self,
        need: list[int],
        group: SequenceGroup,
        out: SchedulerOutput,
        taken: set[int],
        admit: bool,
        reserve: list[int] | None = None,
    ) -> bool:
        """Preempts groups admitted after `group` (latest first, not yet in this step) until every group has
        `need` (+ `reserve`) pages free."""
        while not self.kv.has_room(need, reserve):
            if admit or group not in self.running:
                return False
            later = self.running[self.running.index(group) + 1 :]
            victim = next((g for g in reversed(later) if id(g) not in taken), None)
            if victim is None:
                return False
            self._preempt(victim, out)
        return True

    def _give_way(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """The group cannot grow now: alone it never will (fail it), else it waits for pages (preempt it)."""
        if len(self.running) == 1:
            self.remove(group)
            out.failed.append((group, self._cannot_fit(group)))
        else:
            self._preempt(group, out)

    def _cannot_fit(self, group: SequenceGroup) -> EngineError:
        """Why a group alone in the pool cannot go on. Start-up sizes the pool for one sequence of max_model_len,
        so only a request's several sequences (n, best_of, beams) can outgrow it; one sequence is a bug."""
        pool = f"the KV cache ({self.kv.allocators[0].num_pages} pages of {self.page_size} tokens)"
        if group.params.num_sequences > 1:
            return InvalidRequest(
                f"{pool} cannot hold this request's {group.params.num_sequences} sequences at "
                "once: lower n, best_of or max_tokens",
                param="n",
            )
        return EngineError(f"{pool} could not hold one sequence of {group.seqs[0].num_tokens} tokens")

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        self.num_preemptions += 1
        self.running.remove(group)
        for seq in group.running:
            self.free_seq(seq)
        self.waiting.appendleft(group)  # (under "priority" the next step sorts it in)
        out.preempted.append(group)

    def commit(self, out: SchedulerOutput) -> None:
        """After the step ran and its tokens were appended: the fed tokens are in the cache; newly full pages join
        the prefix cache, pages that fell out of a sliding window are given back. A speculating sequence keeps the
        KV of its last token and of the proposals it accepted (it holds one token less than it has, as after any
        decode); the pages past them go back, so no rejected token is ever hashed or shared."""
        for s in out.scheduled:
            old = s.seq.num_computed_tokens
            if not s.draft:
                self.kv.commit(s.seq, old, old + s.num_tokens)
                continue
            self.kv.commit(s.seq, old, max(old, min(old + s.num_tokens, s.seq.num_tokens - 1)))
            self.kv.trim(s.seq)


def _running_key(group: SequenceGroup) -> tuple[int, int]:
    return group.params.priority, group.arrival
