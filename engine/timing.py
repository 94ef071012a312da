"""Start-up phase timing, shared by the engine and handler.py (which times its imports before torch loads,
so this module imports nothing heavy)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def timed(phases: dict[str, int], name: str) -> Iterator[None]:
    """Records in phases[name] how long the block took, in milliseconds."""
    started = time.perf_counter()
    yield
    phases[name] = round(1000 * (time.perf_counter() - started))
