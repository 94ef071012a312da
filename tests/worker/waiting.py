"""Waiting on a worker's events instead of sleeping: poll a condition until it holds.

Tests size their timeouts from what they measured (a solo answer, a decode step). The first wait of a test
has measured nothing yet, so it gets HANG_S: a guard against a hung worker, not a guess at its speed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
# Only a hung worker reaches it: on two busy cores the slowest first answer of these tests took about 40 s.
HANG_S = 600.0
POLL_S = 0.05


def wait_until(probe: Callable[[], T], what: str, timeout_s: float = HANG_S) -> T:
    """Calls `probe` until it returns something true and returns that; an AssertionError naming `what`
    after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (value := probe()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(POLL_S)
    return value
