"""A draft model proposes: a second, smaller model with the target's tokenizer, run greedily k steps per proposal.

The draft runs on the engine's own code (loader, ModelRunner, attention backend) with its own small KV pool and a
KVCacheManager of its own: the draft's pages are its one owner here, never the scheduler's. Each sequence has a
shadow Sequence on the draft side whose computed prefix follows the target's tokens: after a verify it keeps only
the KV of the tokens the target kept (the longest common prefix), and catches up on the rest in the next
proposal's first forward, chunked to the engine's token budget. Greedy drafts are a point mass, so verification
needs no draft distributions (engine/sample/rejection.py).
"""

from __future__ import annotations

import logging

from engine.attention import create_backend
from engine.config import SpeculativeConfig
from engine.core.kv_cache import PagePool
from engine.core.kv_manager import KVCacheManager
from engine.core.model_runner import ModelRunner
from engine.core.sequence import Sequence, SequenceGroup
from engine.core.spec.proposer import Target
from engine.core.step import ScheduledSeq, SchedulerOutput
from engine.cuda import setup as cuda_setup
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
        self.group = SequenceGroup("draft", [], GREEDY, [self.seq], arrival=0)
        self.synced = seq.num_tokens  # target tokens known to the shadow


class DraftModelProposer:
    """vLLM's "draft_model" method: SpeculativeConfig.model is the draft's folder."""

    name = "draft_model"
    deterministic = True

    def __init__(self, config: SpeculativeConfig, target: Target) -> None:
        self.num_tokens = config.num_speculative_tokens
        self.budget = target.max_num_batched_tokens
        self.path = config.model
        self._check_tokenizer(target)
        self.model, self.spec = load_model(config.model, target.dtype, target.device)
        if self.spec.recurrent is not None:
            raise StartupError(f"the draft model at {config.model} has recurrent layers, which a draft cannot roll "
                               "back", param="speculative.model")
        # Every token id the model reads must be one the draft reads, and every one it proposes one the model has.
        least = min(len(target.tokenizer), target.vocab_size)
        if not least <= self.spec.vocab_size <= target.vocab_size:
            raise StartupError(f"the draft model at {config.model} has a vocabulary of {self.spec.vocab_size} "
                               f"tokens; it needs between {least} and the model's {target.vocab_size}",
                               param="speculative.model")
        groups = self.spec.kv_groups
        page_size = target.page_size
        num_pages = config.draft_kv_pages or target.num_pages
        self.pools = [PagePool.for_group(g, num_pages, page_size, target.kv_dtype, target.device) for g in groups]
        backends = [create_backend(target.backend_name, target.device, **g.attention_extras(), kv_dtype=target.kv_dtype,
                                   **cuda_setup.backend_kwargs(self.spec, target.dtype, g)) for g in groups]
        self.kv = KVCacheManager(groups, [num_pages] * len(groups), page_size, enable_prefix_caching=False)
        self.runner = ModelRunner(self.model, groups, self.pools, backends, Sampler(), target.device)
        self._shadows: dict[int, _Shadow] = {}
        log.info("draft model %s: %d KV pages of %d tokens", config.model, num_pages, page_size)

    def _check_tokenizer(self, target: Target) -> None:
        try:
            draft = load_tokenizer(self.path)
        except Exception as exc:
            raise StartupError(f"the draft model at {self.path} has no tokenizer that loads ({exc})",
                               param="speculative.model") from None
        if draft.get_vocab() != target.tokenizer.get_vocab():
            raise StartupError(f"the draft model at {self.path} has another tokenizer than the model's: a draft "
                               "must share its vocabulary", param="speculative.model")

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
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
            first.scheduled.append(ScheduledSeq(seq, shadow.group, seq.num_computed_tokens, n))
            ready.append(seq.num_computed_tokens + n == seq.num_tokens)
        self._run(first)
        by_seq = {id(s.seq): (s, w) for s, w in zip(shadows, want, strict=True)}
        live = [by_seq[id(s.seq)] for s, ok in zip(first.scheduled, ready, strict=True) if ok]
        # Then greedy decode steps, one proposal each, for the shadows that still want one.
        while live:
            out, stepped = SchedulerOutput(), []
            for shadow, w in live:
                seq = shadow.seq
                if seq.num_tokens - shadow.synced < w and self._allocate(seq, 1, out):
                    out.scheduled.append(ScheduledSeq(seq, shadow.group, seq.num_computed_tokens, 1))
                    stepped.append((shadow, w))
            self._run(out)
            live = stepped
        return [shadow.seq.token_ids[shadow.synced : shadow.synced + w] for shadow, w in zip(shadows, want, strict=True)]

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
        if self._lost_window_pages(seq):
            self.kv.free(seq)  # its windows slid past pages the shorter prefix reads: run it again from the start
        shadow.synced = len(tokens)
        return shadow

    def _lost_window_pages(self, seq: Sequence) -> bool:
        """A window group dropped a page the computed prefix still reads (the draft ran ahead, then was cut back)."""
        if not seq.kv_pages:
            return False
        c, ps = seq.num_computed_tokens, self.kv.page_size
        return any(null is not None and null in seq.kv_pages[g][spec.first_needed_page(c, ps) :]
                   for g, (spec, null) in enumerate(zip(self.kv.specs, self.kv.null_pages, strict=True)))

    def _allocate(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        if not self.kv.has_room(self.kv.needed(seq, n)):
            return False
        self.kv.allocate(seq, n, out.copies)
        return True

    def _run(self, out: SchedulerOutput) -> None:
        """One draft forward; each shadow whose chunk reached its end appends its greedy next token."""
        if not out.scheduled:
            return
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
