"""The one interface every proposer implements: guesses for a batch of decoding sequences."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.core.sequence import Sequence


class Proposer(Protocol):
    """Proposes up to limits[i] next tokens for seqs[i] (fewer, or none, where it has no guess)."""

    name: str
    # Whether the proposals are a point mass (q = 1 on the proposed token), so verification needs no draft logits.
    deterministic: bool

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]: ...

    def retain(self, live: set[int]) -> None:
        """Forgets what it keeps for sequences whose seq_id is not in `live` (finished, aborted, preempted)."""
        ...

    def describe(self) -> dict: ...
