"""Which sequences speculate in a step, how far, and how well it went (acceptance for the log and stats).

A sequence speculates when its request can be verified exactly (no grammar, no beam search, not an embedding) and
the step's batch of decoding sequences is at most disable_by_batch_size. Its proposal never runs past max_tokens
or the context: at most max_tokens - len(output) - 1 and max_model_len - len(tokens) - 1 tokens, as the token the
target adds after the accepted ones must fit too.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, TypedDict

from engine.config import SpeculativeConfig

if TYPE_CHECKING:
    from engine.core.scheduling.sequence import Sequence, SequenceGroup
    from engine.core.scheduling.step import SchedulerOutput, StepResult
    from engine.core.spec.proposer import Proposer

log = logging.getLogger(__name__)

LOG_EVERY_S = 60.0  # the periodic acceptance line, at most this often


def unsupported(group: SequenceGroup) -> str | None:
    """Why this request cannot speculate (None: it can)."""
    if group.pools:
        return "embedding"
    if group.beam is not None:
        return "beam search"
    if any(s.output_state.grammar is not None for s in group.seqs):
        return "structured output"
    return None


class SpeculatorStats(TypedDict):
    """Speculator.stats(): its counts since start-up, part of LLMEngine.stats()."""

    spec_proposed_tokens: int
    spec_accepted_tokens: int
    spec_verify_steps: int
    spec_skipped_steps: int  # steps whose batch was too large to speculate
    spec_acceptance_rate: float
    spec_mean_accepted_length: float  # tokens a speculating sequence gains per verify step


class Speculator:
    """Drives one proposer: proposals before the scheduler runs, acceptance counts after the step."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config, self.proposer, self.max_model_len = config, proposer, max_model_len
        self.num_steps = 0  # steps that verified at least one proposal
        self.num_proposals = 0  # sequences x steps with a proposal
        self.num_proposed = 0  # tokens proposed
        self.num_accepted = 0  # of them accepted
        self.num_skipped_steps = 0  # steps whose batch was too large to speculate
        self._said: set[str] = set()
        self._logged_at = time.monotonic()

    def propose(self, running: list[SequenceGroup]) -> dict[int, list[int]]:
        """seq_id -> proposed tokens, for the decoding sequences of `running` that speculate this step."""
        decoding = [g for g in running if g.forked and all(s.in_decode for s in g.running)]
        if sum(len(g.running) for g in decoding) > self.config.disable_by_batch_size:
            self.num_skipped_steps += 1
            return {}
        seqs: list[Sequence] = []
        limits: list[int] = []
        for group in decoding:
            why = unsupported(group)
            if why is not None:
                self._say_once(why)
                continue
            max_tokens = group.sampling.max_tokens
            assert max_tokens is not None, "filled in when the request was added"
            for seq in group.running:
                limit = min(
                    self.config.num_speculative_tokens,
                    max_tokens - len(seq.output_token_ids) - 1,
                    self.max_model_len - seq.num_tokens - 1,
                )
                if limit > 0:
                    seqs.append(seq)
                    limits.append(limit)
        if not seqs:
            return {}
        proposals = self.proposer.propose(seqs, limits)
        return {s.seq_id: p for s, p in zip(seqs, proposals, strict=True) if p}

    def observe(self, out: SchedulerOutput, result: StepResult) -> None:
        """After a step's tokens are committed: a proposer that reads the target's hidden states reads them."""
        observe = getattr(self.proposer, "observe", None)
        if observe is not None:
            observe(out, result)

    def settle(self, running: list[SequenceGroup]) -> None:
        """After a step: the proposer forgets the sequences that finished, left or were preempted."""
        self.proposer.retain({s.seq_id for g in running for s in g.running})

    def record(self, proposed: list[int], accepted: list[int]) -> None:
        """One step's proposal lengths and accepted counts (per speculating sequence)."""
        if not proposed:
            return
        self.num_steps += 1
        self.num_proposals += len(proposed)
        self.num_proposed += sum(proposed)
        self.num_accepted += sum(accepted)
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY_S:
            self._logged_at = now
            s = self.stats()
            log.info(
                "speculative decoding (%s): %.0f%% of %d proposed tokens accepted, %.2f tokens per verify",
                self.proposer.name,
                100 * s["spec_acceptance_rate"],
                self.num_proposed,
                s["spec_mean_accepted_length"],
            )

    def stats(self) -> SpeculatorStats:
        rate = self.num_accepted / self.num_proposed if self.num_proposed else 0.0
        # Tokens a speculating sequence gains per verify step: its accepted ones and the target's own next one.
        mean = 1.0 + self.num_accepted / self.num_proposals if self.num_proposals else 0.0
        return {
            "spec_proposed_tokens": self.num_proposed,
            "spec_accepted_tokens": self.num_accepted,
            "spec_verify_steps": self.num_steps,
            "spec_skipped_steps": self.num_skipped_steps,
            "spec_acceptance_rate": round(rate, 4),
            "spec_mean_accepted_length": round(mean, 3),
        }

    def describe(self) -> dict:
        return {
            "method": self.proposer.name,
            "num_speculative_tokens": self.config.num_speculative_tokens,
            "disable_by_batch_size": self.config.disable_by_batch_size,
            **self.proposer.describe(),
        }

    def _say_once(self, why: str) -> None:
        if why not in self._said:
            self._said.add(why)
            log.info("speculative decoding: requests with %s run without it", why)
