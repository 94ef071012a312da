"""Graceful shutdown: on SIGTERM, running requests get a grace period to finish; the rest then end with a
clear 503 error (their KV pages freed) instead of a dropped connection, and new ones are refused.

Whatever stops taking work (RunPod's SDK stops fetching jobs, uvicorn stops accepting connections) keeps
its own SIGTERM handler: `watch_sigterm` chains onto it, so both behaviours happen.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from typing import Any

from engine.errors import ShuttingDown

log = logging.getLogger("worker")
POLL_S = 0.1


class Drain:
    """Counts down the grace period once SIGTERM arrives, then fails what is still running."""

    def __init__(self, engine: Any, grace_s: float) -> None:
        self.engine = engine  # AsyncEngine: num_running, fail_all
        self.grace_s = grace_s
        self.draining = False
        self._chained = False
        self._task: asyncio.Task | None = None

    def watch_sigterm(self) -> None:
        """Chain onto the SIGTERM handler installed now (once); only the main thread may do it."""
        if self._chained or threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)
        loop = asyncio.get_running_loop()

        def on_sigterm(signum: int, frame: Any) -> None:
            loop.call_soon_threadsafe(self.begin)
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGTERM, on_sigterm)
        self._chained = True

    def begin(self) -> None:
        """Start draining (on the event loop); a second call changes nothing."""
        if not self.draining:
            self.draining = True
            log.info("SIGTERM: %d requests running, %.1f s to finish", self.engine.num_running, self.grace_s)
            self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.grace_s
        while self.engine.num_running and loop.time() < deadline:
            await asyncio.sleep(POLL_S)
        failed = self.engine.fail_all(
            ShuttingDown(
                f"The worker is shutting down and this request did not finish within its {self.grace_s:g} s grace "
                "period; retry it."
            )
        )
        log.info("grace period over: %d requests ended with an error", failed)
