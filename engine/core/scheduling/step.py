"""What one step passes along: the scheduler's plan (SchedulerOutput of ScheduledSeq) and the runner's result
(StepResult of Sample). Neutral ground, so that the output side imports neither the scheduler nor the runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.core.scheduling.sequence import Sequence, SequenceGroup
from engine.errors import EngineError
from engine.sample.logits_processor import SamplingRow

if TYPE_CHECKING:
    import torch


@dataclass(kw_only=True)
class ScheduledSeq:
    """Feed seq.token_ids[start:start + num_tokens] this step; a speculating sequence's num_tokens also counts its
    proposed tokens (`draft`), fed after its last known one and verified by the runner."""

    seq: Sequence
    group: SequenceGroup
    start: int
    num_tokens: int
    draft: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the known tokens, so its last row predicts the next one."""
        return self.start + self.num_tokens - len(self.draft) == self.seq.num_tokens


@dataclass(kw_only=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    # (KV layer group, src, dst): pages to copy before the step (copy-on-write of a shared partly filled page)
    copies: list[tuple[int, int, int]] = field(default_factory=list)
    # (src, dst) recurrent-state slots to copy before the step, in order (engine/core/kv/state_cache.py)
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[SequenceGroup] = field(default_factory=list)
    failed: list[tuple[SequenceGroup, EngineError]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


@dataclass
class Sample:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] | None = None


@dataclass(kw_only=True)
class StepResult:
    """Per scheduled sequence (by index in SchedulerOutput.scheduled): what the step produced for it."""

    # One Sample per choice for a group's first token (n, best_of), a beam's 2*width best candidates, a speculating
    # sequence's accepted tokens in order (its accepted proposals, then the target's own next token), else the one
    # sampled token.
    samples: dict[int, list[Sample]] = field(default_factory=dict)
    # (logprob of the next prompt token, its top-k) for each prompt position of the chunk that has one.
    prompt_logprobs: dict[int, list[tuple[float, list[tuple[int, float]]]]] = field(default_factory=dict)
    errors: dict[int, Exception] = field(default_factory=dict)  # sampling failed for that sequence alone
    # An embedding request's final hidden states of the chunk it ran (folded by the output processor).
    pooled: dict[int, torch.Tensor] = field(default_factory=dict)
    # With an EAGLE-3 head: the target's captured hidden states of every row of the step, side by side.
    aux_hidden: torch.Tensor | None = None
    # With an MTP head: the target's final hidden states (after its last norm) of every row of the step.
    hidden: torch.Tensor | None = None


def sampling_row(group: SequenceGroup, seq: Sequence) -> SamplingRow:
    """The sampler's view of one sequence this step."""
    return SamplingRow(
        params=group.sampling,
        prompt_token_ids=group.prompt_token_ids,
        output_token_ids=seq.output_token_ids,
        generator=seq.output_state.generator,
        eos_token_ids=group.eos_token_ids,
        bad_words_ids=group.bad_words_ids,
        grammar=seq.output_state.grammar,
        penalties=seq.output_state.penalties,
    )
