"""A draft model proposes: a second, smaller model with the target's tokenizer, run greedily k steps per proposal.

The draft runs on the engine's own code (loader, ModelRunner, attention backend) with its own small KV pool and a
KVCacheManager of its own: the draft's pages are its one owner here, never the scheduler's. Each sequence has a
shadow Sequence on the draft side whose computed prefix follows the target's tokens: after a verify it keeps only
the KV of the tokens the target kept (the longest common prefix), and catches up on the rest in the next
proposal's first forward, chunked to the engine's token budget. Greedy drafts are a point mass, so verification
needs no draft distributions (engine/sample/rejection.py).

A hybrid draft (a small Qwen3.5 for a large one) keeps a recurrent-state slot per shadow, which cannot be cut back
as pages are: once a shadow has caught up on the target's tokens, its state is copied to a second slot (the
snapshot half of its StateSlots, unused with prefix caching off) before the greedy steps, and copied back after
them, so the shadow stands again at the target's tokens, which a verify never takes back. Its next proposal
catches up on the tokens the target kept since. The slots are sized for the sequences that speculate at once
(disable_by_batch_size); a shadow beyond them gives its slot and pages up, least recently used first, and runs
its sequence again from the start when it next proposes.
"""

from __future__ import annotations

import logging

from engine.attention import create_group_backends
from engine.config import SpeculativeConfig
from engine.core.kv.cache import PagePool
from engine.core.kv.manager import KVCacheManager
from engine.core.kv.state_cache import StatePool, StateSlots
from engine.core.model_runner import ModelRunner
from engine.core.scheduling.sequence import Sequence, SequenceGroup
from engine.core.scheduling.step import ScheduledSeq, SchedulerOutput
from engine.core.spec.proposer import Target
from engine.errors import StartupError
from engine.model.loader import load_model
from engine.sample.params import SamplingParams
from engine.sample.sampler import Sampler
from engine.text.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


class _Shadow:
    """The draft side of one target sequence: its Sequence (tokens, draft pages) and a one-sequence group."""

    def __init__(self, seq: Sequence) -> None:
        self.seq = Sequence(seq_id=seq.seq_id, token_ids=list(seq.token_ids), num_prompt_tokens=seq.num_prompt_tokens)
        self.group = SequenceGroup(request_id="draft", prompt_token_ids=[], params=GREEDY, seqs=[self.seq], arrival=0)
        self.synced = seq.num_tokens  # target tokens known to the shadow
        self.state_at = 0  # a hybrid draft's: the tokens its state slot has run


class DraftModelProposer:
    """vLLM's "draft_model" method: SpeculativeConfig.model is the draft's folder."""

    name = "draft_model"
    deterministic = True

    def __init__(self, config: SpeculativeConfig, target: Target) -> None:
        self.num_tokens = config.num_speculative_tokens
        self.budget = target.max_num_batched_tokens
        assert config.model is not None, "check_config: draft_model names its model"
        self.path = config.model
        self._check_tokenizer(target)
        self.model, self.spec = load_model(
            config.model, target.dtype, target.device, max_model_len=target.max_model_len
        )
        # Every token id the model reads must be one the draft reads, and every one it proposes one the model has.
        least = min(len(target.tokenizer), target.vocab_size)
        if not least <= self.spec.vocab_size <= target.vocab_size:
            raise StartupError(
                f"the draft model at {config.model} has a vocabulary of {self.spec.vocab_size} "
                f"tokens; it needs between {least} and the model's {target.vocab_size}",
                param="speculative.model",
            )
        groups = self.spec.kv_groups
        page_size = target.page_size
        num_pages = config.draft_kv_pages or target.num_pages
        self.pools = [PagePool.for_group(g, num_pages, page_size, target.kv_dtype, target.device) for g in groups]
        backends = create_group_backends(
            target.backend_name, groups, target.device, spec=self.spec, dtype=target.dtype, kv_dtype=target.kv_dtype
        )
        recurrent, state, state_pool = self.spec.recurrent, None, None
        if recurrent is not None:  # a slot per shadow and one for its state before the greedy steps
            state = StateSlots(min(target.max_num_seqs, config.disable_by_batch_size), enable_prefix_caching=False)
            state_pool = StatePool(recurrent, state.num_slots, target.dtype, target.device)
        self.kv = KVCacheManager(
            specs=groups,
            num_pages=[num_pages] * len(groups),
            page_size=page_size,
            enable_prefix_caching=False,
            state=state,
        )
        self.runner = ModelRunner(
            model=self.model,
            groups=groups,
            pools=self.pools,
            backends=backends,
            sampler=Sampler(),
            device=target.device,
            recurrent=recurrent,
            state_pool=state_pool,
        )
        self._shadows: dict[int, _Shadow] = {}  # least recently proposing first
        self._state_copies: list[tuple[int, int]] = []  # a hybrid draft's saves and restores, for the next forward
        log.info("draft model %s: %d KV pages of %d tokens", config.model, num_pages, page_size)

    def _check_tokenizer(self, target: Target) -> None:
        try:
            draft = load_tokenizer(self.path)
        except Exception as exc:
            raise StartupError(
                f"the draft model at {self.path} has no tokenizer that loads ({exc})", param="speculative.model"
            ) from None
        if draft.get_vocab() != target.tokenizer.get_vocab():
            raise StartupError(
                f"the draft model at {self.path} has another tokenizer than the model's: a draft "
                "must share its vocabulary",
                param="speculative.model",
            )

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        self._make_room({seq.seq_id for seq in seqs})
        shadows = [self._sync(seq) for seq in seqs]
        want = [min(limit, self.num_tokens) for limit in limits]
        # First forward: catch each shadow up on the tokens it has not run (its last one predicts proposal 1).
        budget, first, ready = self.budget, SchedulerOutput(), []
        for shadow in shadows:
            seq = shadow.seq
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n <= 0 or not self._allocate(seq, n, first):
                continue
            budget -= n
            first.scheduled.append(
                ScheduledSeq(seq=seq, group=shadow.group, start=seq.num_computed_tokens, num_tokens=n)
            )
            ready.append(seq.num_computed_tokens + n == seq.num_tokens)
        self._run(first)
        by_seq = {id(s.seq): (s, w) for s, w in zip(shadows, want, strict=True)}
        live = [by_seq[id(s.seq)] for s, ok in zip(first.scheduled, ready, strict=True) if ok]
        saved = [(shadow, shadow.seq.num_computed_tokens) for shadow, _ in live if self.kv.state is not None]
        for shadow, _ in saved:
            self._state_copies.append((shadow.seq.state_slot, self._saved_slot(shadow)))
        # Then greedy decode steps, one proposal each, for the shadows that still want one.
        while live:
            out, stepped = SchedulerOutput(), []
            for shadow, w in live:
                seq = shadow.seq
                if seq.num_tokens - shadow.synced < w and self._allocate(seq, 1, out):
                    out.scheduled.append(
                        ScheduledSeq(seq=seq, group=shadow.group, start=seq.num_computed_tokens, num_tokens=1)
                    )
                    stepped.append((shadow, w))
            self._run(out)
            live = stepped
        for shadow, computed in saved:  # back to the target's tokens (applied before the next forward)
            self._state_copies.append((self._saved_slot(shadow), shadow.seq.state_slot))
            shadow.seq.num_computed_tokens = computed
        for shadow in shadows:
            shadow.state_at = shadow.seq.num_computed_tokens
        return [
            shadow.seq.token_ids[shadow.synced : shadow.synced + w] for shadow, w in zip(shadows, want, strict=True)
        ]

    def _saved_slot(self, shadow: _Shadow) -> int:
        """The slot of the snapshot half paired with the shadow's (the shadows never reach that half: _make_room)."""
        return shadow.seq.state_slot + self.kv.state.num_seqs

    def _make_room(self, keep: set[int]) -> None:
        """A hybrid draft: shadows past its slots, least recently proposing first and none of `keep`, give up their
        state and pages; the ones in `keep` move to the most recent end."""
        for key in keep:
            if key in self._shadows:
                self._shadows[key] = self._shadows.pop(key)
        if self.kv.state is None:
            return
        extra = len(self._shadows) + len(keep - self._shadows.keys()) - self.kv.state.num_seqs
        for key in [key for key in self._shadows if key not in keep][: max(0, extra)]:
            self.kv.free(self._shadows.pop(key).seq)

    def _sync(self, target: Sequence) -> _Shadow:
        """The shadow of `target`, its KV cut back to the prefix it shares with the target's tokens."""
        shadow = self._shadows.get(target.seq_id)
        if shadow is None:
            shadow = self._shadows[target.seq_id] = _Shadow(target)
        seq, tokens = shadow.seq, target.token_ids
        same = min(shadow.synced, len(tokens))
        while same < min(len(seq.token_ids), len(tokens)) and seq.token_ids[same] == tokens[same]:
            same += 1
        seq.token_ids = list(tokens)
        seq.num_computed_tokens = min(seq.num_computed_tokens, same, len(tokens) - 1)
        self.kv.trim(seq)
        behind = self.kv.state is not None and seq.num_computed_tokens != shadow.state_at
        if behind or self._lost_window_pages(seq):
            # its windows slid past pages the shorter prefix reads, or its state ran past it: run it from the start
            self.kv.free(seq)
        shadow.synced = len(tokens)
        return shadow

    def _lost_window_pages(self, seq: Sequence) -> bool:
        """A window group dropped a page the computed prefix still reads (the draft ran ahead, then was cut back)."""
        if not seq.kv_pages:
            return False
        c, ps = seq.num_computed_tokens, self.kv.page_size
        return any(
            null is not None and null in seq.kv_pages[g][spec.first_needed_page(c, ps) :]
            for g, (spec, null) in enumerate(zip(self.kv.specs, self.kv.null_pages, strict=True))
        )

    def _allocate(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        if not self.kv.has_room(self.kv.needed(seq, n)):
            return False
        self.kv.allocate(seq, n, out.copies)
        return True

    def _run(self, out: SchedulerOutput) -> None:
        """One draft forward; each shadow whose chunk reached its end appends its greedy next token."""
        if not out.scheduled:
            return
        if self.kv.state is not None:
            # The saves and restores first: a restore into the slot of a shadow given up since, then zeroed for its
            # new owner, leaves zeros.
            out.state_copies = self._state_copies + self.kv.state.drain()
            self._state_copies = []
        result = self.runner.execute(out)
        for i, s in enumerate(out.scheduled):
            old = s.seq.num_computed_tokens
            self.kv.commit(s.seq, old, old + s.num_tokens)
            if i in result.samples:
                s.seq.token_ids.append(result.samples[i][0].token_id)

    def retain(self, live: set[int]) -> None:
        for key in [key for key in self._shadows if key not in live]:
            self.kv.free(self._shadows.pop(key).seq)

    def describe(self) -> dict:
        return {"model": self.path}
