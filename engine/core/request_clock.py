"""One generation request's outputs timed as they reach the caller, told to the engine's RequestObserver."""

from __future__ import annotations

import time

from engine.outputs import FinishedRequest, RequestObserver, RequestOutput


class RequestClock:
    """Started when generate() is called; `arrived` once per output, `end` once when the request's stream ends."""

    def __init__(self, observer: RequestObserver) -> None:
        self.observer = observer
        self.start = time.perf_counter()
        self.last: float | None = None  # when the latest generated tokens arrived
        self.latest: RequestOutput | None = None
        self.reasons: list[str] = []

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
        """The request ended: finished, aborted, or its stream closed early (then one more "abort")."""
        latest = self.latest
        reasons = self.reasons if latest is not None and latest.finished else [*self.reasons, "abort"]
        self.observer.finished(
            FinishedRequest(
                prompt_tokens=0 if latest is None else latest.num_prompt_tokens or len(latest.prompt_token_ids),
                cached_tokens=0 if latest is None else latest.num_cached_tokens,
                generation_tokens=0 if latest is None else latest.num_generated_tokens,
                finish_reasons=reasons,
                seconds=time.perf_counter() - self.start,
            )
        )
