"""The output side of one sequence: what turns its sampled tokens into a choice's text, logprobs and stops.

The output processor owns it (the sampler reads the grammar, and advances the RNG stream and the penalty counts); the
scheduler, which owns the sequence's KV side (tokens, pages, computed length), never touches it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.outputs import PositionLogprobs

if TYPE_CHECKING:
    import torch

    from engine.sample.params import StopReader
    from engine.sample.penalties import PenaltyCounts
    from engine.sample.structured.matcher import GrammarState
    from engine.text.detokenizer import Detokenizer


@dataclass(eq=False, kw_only=True)
class OutputState:
    """A choice's detokenizer and text so far, its logprobs, its grammar state, its stop reader, its RNG and its
    penalty counts."""

    detokenizer: Detokenizer | None = None
    text: str = ""
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    # Where the output stands in the request's grammar; it keeps its state across preemption (the matcher has
    # accepted every output token, and recompute replays them through the model only).
    grammar: GrammarState | None = None
    stop_reader: StopReader | None = None  # the request's own stop condition on this choice's text
    generator: torch.Generator | None = None  # a seeded choice's own RNG stream
    # A penalised choice's running token counts: written by the sampler alone, a cache of its output tokens that
    # survives preemption with them (engine/sample/penalties.py says why it lives here).
    penalties: PenaltyCounts | None = None
    pooled: torch.Tensor | None = (
        None  # an embedding request's pooled hidden states so far (engine/core/output/pooling.py)
    )

    def fork(self) -> OutputState:
        """A beam's child: the grammar state and penalty counts forked; the text side of a beam is rebuilt when it
        finishes."""
        return OutputState(
            grammar=self.grammar.fork() if self.grammar is not None else None,
            penalties=self.penalties.fork() if self.penalties is not None else None,
        )
