"""Requests whose grammar is still compiling (off the engine loop) wait here, outside the scheduler, while the
others go on decoding."""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures

from engine.core.scheduling.sequence import SequenceGroup

# How long an idle step waits for a grammar compile before it returns (and the caller's loop looks again).
COMPILE_POLL_S = 0.02


class GrammarWait:
    """request id -> (its group, the future of its compiled grammar)."""

    def __init__(self) -> None:
        self._waiting: dict[str, tuple[SequenceGroup, Future]] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, request_id: str, group: SequenceGroup, future: Future) -> None:
        self._waiting[request_id] = (group, future)

    def drop(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    def finished(self, idle: bool) -> list[tuple[SequenceGroup, Future]]:
        """Takes out the requests whose compile is over (done or failed); when `idle` (nothing else to run) it first
        waits a little for one instead of letting the caller spin."""
        if not self._waiting:
            return []
        if idle:
            wait_futures([f for _, f in self._waiting.values()], timeout=COMPILE_POLL_S, return_when=FIRST_COMPLETED)
        done = [request_id for request_id, (_, future) in self._waiting.items() if future.done()]
        return [self._waiting.pop(request_id) for request_id in done]
