"""What AsyncEngine tells a watcher (the worker's metrics) about each generation request as its outputs arrive.

Times are taken where the caller receives the outputs, once per output (a step's tokens for the request), never per
token; the clock starts when generate() is called.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from engine.outputs import RequestOutput


@dataclass(kw_only=True)
class FinishedRequest:
    """A generation request at its end: its token counts, how each choice ended, and how long it took."""

    prompt_tokens: int
    generation_tokens: int  # over all choices
    finish_reasons: list[str]  # one per choice: "stop", "length", or "abort" (also for a stream closed early)
    seconds: float  # from generate() to the last output


class RequestObserver(Protocol):
    """Told about every generation request (not embeddings or scores) from the caller's thread."""

    def first_token(self, seconds: float) -> None:
        """The first generated tokens arrived, `seconds` after the request came."""
        ...

    def next_tokens(self, seconds: float) -> None:
        """More generated tokens arrived, `seconds` after the previous ones."""
        ...

    def finished(self, request: FinishedRequest) -> None: ...


@dataclass
class RequestClock:
    """One request's outputs timed as they arrive, told to `observer`."""

    observer: RequestObserver
    start: float = field(default_factory=time.perf_counter)
    last: float | None = None  # when the latest generated tokens arrived
    latest: RequestOutput | None = None
    reasons: list[str] = field(default_factory=list)

    def arrived(self, output: RequestOutput) -> None:
        now = time.perf_counter()
        generated = self.latest.num_generated_tokens if self.latest is not None else 0
        if output.num_generated_tokens > generated:
            if self.last is None:
                self.observer.first_token(now - self.start)
            else:
                self.observer.next_tokens(now - self.last)
            self.last = now
        self.reasons += [delta.finish_reason for delta in output.outputs if delta.finish_reason]
        self.latest = output

    def end(self) -> None:
        """The request ended (finished, aborted, or its stream closed early: then its open choices count as
        aborted)."""
        latest = self.latest
        reasons = self.reasons if latest is not None and latest.finished else [*self.reasons, "abort"]
        self.observer.finished(
            FinishedRequest(
                prompt_tokens=0 if latest is None else latest.num_prompt_tokens or len(latest.prompt_token_ids),
                generation_tokens=0 if latest is None else latest.num_generated_tokens,
                finish_reasons=reasons,
                seconds=time.perf_counter() - self.start,
            )
        )
