"""GrammarState: one sequence's position in its grammar (an xgrammar GrammarMatcher).

It advances once per accepted output token and never rewinds: preemption by recompute replays the
sequence's tokens through the model but not through the matcher, which already holds them.
"""

from __future__ import annotations

from typing import Any

from engine.errors import EngineError


class GrammarState:
    """Advances with each accepted token; `terminated` once the grammar has ended (a stop token accepted)."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    @classmethod
    def start(cls, compiled: Any) -> GrammarState:
        import xgrammar as xgr

        return cls(xgr.GrammarMatcher(compiled))

    def accept(self, token_id: int) -> None:
        if self.matcher.is_terminated():
            return  # the grammar ended on a stop token the sequence was told to ignore (ignore_eos)
        if not self.matcher.accept_token(token_id):
            # The mask allows only tokens the grammar accepts: reaching this is a bug, not a bad request.
            raise EngineError(f"the grammar rejected token {token_id}, which its own mask allowed")

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fork(self) -> GrammarState:
        """An independent copy at the same position (a beam chosen twice)."""
        return GrammarState(self.matcher.fork())
