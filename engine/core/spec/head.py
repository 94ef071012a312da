"""A draft head that reads the target's hidden states proposes (EAGLE-3, MTP): the shared machinery.

The head keeps its own KV pages (its own KVCacheManager, their one owner here). Head position p pairs token p+1 with
a feature of position p, so each target sequence has a shadow Sequence whose tokens are the target's shifted by one.
After every target step (observe), the head catches up on the positions the target computed and kept, with the
target's hidden states of them as features; the last of those rows guesses the first token. propose() then runs
k - 1 more head steps, each fed its previous row's carried output (head.carry); their KV is speculative and cut back
at the next observe. Greedy guesses are a point mass, so verification needs no draft distributions.

Positions the target never computed for a sequence (a prefix-cache hit) have no target features: the head runs
them with zero features, which lowers its guesses there, never the output (verification keeps it exact).

A subclass loads its head (a model the ModelRunner runs, with `features` set before each forward and `carry` read
after it) and says which of the step's hidden states are its features (features()).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.attention import create_group_backends
from engine.core.kv.cache import PagePool
from engine.core.kv.manager import KVCacheManager
from engine.core.model_runner import ModelRunner
from engine.core.scheduling.sequence import Sequence, SequenceGroup
from engine.core.scheduling.step import ScheduledSeq, SchedulerOutput, StepResult
from engine.core.spec.proposer import Target
from engine.core.spec.speculator import unsupported
from engine.sample.params import SamplingParams
from engine.sample.sampler import Sampler

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


class _Shadow:
    """The head's side of one target sequence: tokens shifted by one, head pages, and the feature for its next
    guess (the carried row of its last computed position)."""

    def __init__(self, seq_id: int, name: str) -> None:
        self.seq = Sequence(seq_id=seq_id, token_ids=[], num_prompt_tokens=0)
        self.group = SequenceGroup(request_id=name, prompt_token_ids=[], params=GREEDY, seqs=[self.seq], arrival=0)
        self.valid = 0  # head positions computed from the target's own features (the rest are guesses)
        self.feature: torch.Tensor | None = None  # [hidden]: for the head step after the last computed position


class HeadProposer:
    """Runs a hidden-state head (self.head, built by the subclass before calling start())."""

    name = "head"
    deterministic = True

    def start(self, head: Any, args, num_tokens: int, num_pages: int, target: Target) -> None:
        """Its KV pool and runner, once the subclass has loaded `head` (of shape `args`): an nn.Module with the
        family's kv_groups(), and the `features` and `carry` tensors above."""
        self.head, self.num_tokens, self.budget = head, num_tokens, target.max_num_batched_tokens
        groups = head.kv_groups({})
        self.pools = [
            PagePool.for_group(g, num_pages, target.page_size, target.kv_dtype, target.device) for g in groups
        ]
        backends = create_group_backends(
            target.backend_name, groups, target.device, spec=args, dtype=target.dtype, kv_dtype=target.kv_dtype
        )
        self.kv = KVCacheManager(
            specs=groups, num_pages=[num_pages] * len(groups), page_size=target.page_size, enable_prefix_caching=False
        )
        self.runner = ModelRunner(
            model=head, groups=groups, pools=self.pools, backends=backends, sampler=Sampler(), device=target.device
        )
        self._shadows: dict[int, _Shadow] = {}

    def features(self, result: StepResult) -> torch.Tensor | None:
        """The target's hidden states this head reads, a row per input row of the step."""
        raise NotImplementedError

    def observe(self, out: SchedulerOutput, result: StepResult) -> None:
        """After a target step: the head catches up on what the target computed and kept (its features)."""
        features = self.features(result)
        if features is None:
            return
        step, budget, row = SchedulerOutput(), self.budget, 0
        feeds: list[torch.Tensor] = []
        for s in out.scheduled:
            first, row = row, row + s.num_tokens
            seq = s.seq
            if s.group.pools or unsupported(s.group) is not None or s.group.finished:
                continue
            shadow = self._shadows.get(seq.seq_id)
            if shadow is None:
                shadow = self._shadows[seq.seq_id] = _Shadow(seq.seq_id, self.name)
            head = shadow.seq
            # The head's rows stay valid up to where this step's features start, and where the target kept them.
            keep = min(shadow.valid, s.start)
            end = min(seq.num_computed_tokens, seq.num_tokens - 1)  # head position p needs token p + 1
            keep = self._cut(shadow, keep, seq)
            n = end - keep
            if n <= 0 or n > budget or not self._allocate(head, n, step):
                continue
            budget -= n
            gap = s.start - keep  # positions with no target features (a prefix-cache hit)
            rows = features[first : first + min(s.num_tokens, end - s.start)] if end > s.start else features[:0]
            feeds.append(torch.cat([rows.new_zeros(gap, rows.shape[-1]), rows]) if gap > 0 else rows)
            step.scheduled.append(ScheduledSeq(seq=head, group=shadow.group, start=keep, num_tokens=n))
            shadow.valid = end
        if step.scheduled:
            self._run(step, torch.cat(feeds))

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """Up to limits[i] guesses for each sequence whose head has caught up with it."""
        want = [min(limit, self.num_tokens) for limit in limits]
        shadows = [self._ready(seq) for seq in seqs]
        live = [(sh, w) for sh, w in zip(shadows, want, strict=True) if sh is not None and w > 1]
        while live:
            step, feeds, stepped = SchedulerOutput(), [], []
            for shadow, w in live:
                head = shadow.seq
                if head.num_tokens - shadow.valid < w and self._allocate(head, 1, step):
                    step.scheduled.append(
                        ScheduledSeq(seq=head, group=shadow.group, start=head.num_computed_tokens, num_tokens=1)
                    )
                    assert shadow.feature is not None, "a ready shadow has its next feature"
                    feeds.append(shadow.feature[None])
                    stepped.append((shadow, w))
            if step.scheduled:
                self._run(step, torch.cat(feeds))
            live = stepped
        return [
            [] if sh is None else sh.seq.token_ids[sh.valid : sh.valid + w] for sh, w in zip(shadows, want, strict=True)
        ]

    def _ready(self, seq: Sequence) -> _Shadow | None:
        """The sequence's shadow when it holds the head's first guess for it (the head saw all it computed)."""
        shadow = self._shadows.get(seq.seq_id)
        c = seq.num_computed_tokens
        if shadow is None or shadow.valid != c or seq.num_tokens != c + 1 or shadow.feature is None:
            return None
        head = shadow.seq
        if head.num_tokens != c + 1 or head.token_ids[:c] != seq.token_ids[1 : c + 1]:
            return None
        return shadow

    def _cut(self, shadow: _Shadow, keep: int, target: Sequence) -> int:
        """Cuts the head's KV back to at most `keep` positions and its tokens to the target's, shifted by one;
        the positions it keeps."""
        head = shadow.seq
        head.token_ids = list(target.token_ids[1:])
        head.num_computed_tokens = min(head.num_computed_tokens, keep)
        self.kv.trim(head)
        shadow.valid, shadow.feature = head.num_computed_tokens, None
        return shadow.valid

    def _allocate(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        if not self.kv.has_room(self.kv.needed(seq, n)):
            return False
        self.kv.allocate(seq, n, out.copies)
        return True

    def _run(self, out: SchedulerOutput, features: torch.Tensor) -> None:
        """One head forward on `features` (a row per input token); each shadow appends its greedy guess and keeps
        its last row's carried output as the feature of its next step."""
        self.head.features = features
        result = self.runner.execute(out)
        row = 0
        for i, s in enumerate(out.scheduled):
            row += s.num_tokens
            old = s.seq.num_computed_tokens
            self.kv.commit(s.seq, old, old + s.num_tokens)
            shadow = self._shadows[s.seq.seq_id]
            if i in result.samples:
                s.seq.token_ids.append(result.samples[i][0].token_id)
                shadow.feature = self.head.carry[row - 1]
        self.head.features = None

    def retain(self, live: set[int]) -> None:
        for key in [key for key in self._shadows if key not in live]:
            self.kv.free(self._shadows.pop(key).seq)
