"""Beam search bookkeeping: which beams live on, which are finished, which n come back (no tensors here).

The engine runs one sequence per live beam, asks the sampler for each beam's top 2*width next tokens,
and hands them to BeamSearch.step, which returns the next live beams (each naming the beam it extends,
so the engine can fork that beam's KV pages). Scores are length-penalised as in vLLM / HF:
cum_logprob / length**length_penalty.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def beam_score(cum_logprob: float, length: int, length_penalty: float) -> float:
    """Length-penalised score; `length` counts generated tokens (a final eos not counted), at least 1."""
    return cum_logprob / (max(length, 1) ** length_penalty)


@dataclass(kw_only=True)
class Beam:
    token_ids: list[int] = field(default_factory=list)  # generated tokens (the prompt is not included)
    cum_logprob: float = 0.0
    finished: bool = False
    parent: int = -1  # index in the previous live list of the beam this one extends
    logprobs: list[float] = field(default_factory=list)  # per generated token

    def score(self, length_penalty: float, eos_token_ids: set[int]) -> float:
        length = len(self.token_ids)
        if self.finished and self.token_ids and self.token_ids[-1] in eos_token_ids:
            length -= 1
        return beam_score(self.cum_logprob, length, length_penalty)


class BeamSearch:
    """State of one request's beam search: `live` beams to extend and up to `width` `finished` ones."""

    def __init__(
        self,
        *,
        width: int,
        length_penalty: float = 1.0,
        early_stopping: bool = False,
        stop_token_ids: set[int] | None = None,
        max_tokens: int | None = None,
    ) -> None:
        self.width = width
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.stop_token_ids = set(stop_token_ids or ())
        self.max_tokens = max_tokens
        self.live: list[Beam] = [Beam()]
        self.finished: list[Beam] = []

    def _score(self, beam: Beam) -> float:
        return beam.score(self.length_penalty, self.stop_token_ids)

    def step(self, candidates: list[list[tuple[int, float]]]) -> list[Beam]:
        """candidates[i]: live beam i's best next (token id, logprob), at least 2*width of them.

        Returns the new live beams (at most width), best first; beams ending in a stop token join
        `finished` when they rank among the best `width` candidates, as in HF.
        """
        assert len(candidates) == len(self.live)
        pool = [
            (beam.cum_logprob + lp, parent, tok, lp)
            for parent, (beam, cands) in enumerate(zip(self.live, candidates, strict=True))
            for tok, lp in cands
        ]
        # Live candidates all have the same length, so the raw sum orders them.
        pool.sort(key=lambda c: c[0], reverse=True)
        live: list[Beam] = []
        for rank, (cum, parent, tok, lp) in enumerate(pool):
            src = self.live[parent]
            beam = Beam(
                token_ids=src.token_ids + [tok],
                cum_logprob=cum,
                finished=False,
                parent=parent,
                logprobs=src.logprobs + [lp],
            )
            if tok in self.stop_token_ids:
                if rank < self.width:
                    beam.finished = True
                    self._add_finished(beam)
                continue
            live.append(beam)
            if len(live) == self.width:
                break
        if self.max_tokens is not None and live and len(live[0].token_ids) >= self.max_tokens:
            for beam in live:
                beam.finished = True
                self._add_finished(beam)
            live = []
        self.live = live
        return live

    def _add_finished(self, beam: Beam) -> None:
        self.finished.append(beam)
        self.finished.sort(key=self._score, reverse=True)
        del self.finished[self.width :]

    @property
    def done(self) -> bool:
        """No live beam can still beat the worst of `width` finished ones (or none is left)."""
        if not self.live:
            return True
        if len(self.finished) < self.width:
            return False
        if self.early_stopping:
            return True
        # HF's heuristic: the best live beam, scored at its current length, against the worst finished.
        best_live = max(b.cum_logprob for b in self.live)
        length = len(self.live[0].token_ids)
        return self._score(self.finished[-1]) >= beam_score(best_live, length, self.length_penalty)

    def best(self, n: int) -> list[Beam]:
        """The n best beams when the engine stops: the finished ones once `width` of them are in (as HF and
        vLLM return them; a live beam then lost already), else the finished and the live ones together."""
        beams = self.finished if len(self.finished) >= self.width else self.finished + self.live
        return sorted(beams, key=self._score, reverse=True)[:n]
