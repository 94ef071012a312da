"""How many jobs the worker holds at once: as many as the engine's KV cache and batch slots take, within
MAX_CONCURRENCY.

One rule for the local endpoint's job queue and RunPod's SDK (its `concurrency_modifier`):

- idle, nothing measured yet: the bound (min of MAX_CONCURRENCY and MAX_NUM_SEQS, the engine's batch slots);
- idle, after work: the KV pages over the pages a request was last seen to hold (so a worker that was full
  does not take a burst it cannot hold);
- working: the jobs running plus as many as the free pages hold at the pages each running request holds now;
- preempting (it preempted, and still holds requests it has no room for): no more than run now.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Pages per request, smoothed over the samples taken while requests run (a decode step changes it little).
SMOOTHING = 0.2


class ConcurrencyGauge:
    """Reads the engine's live stats (`AsyncEngine.stats()` / `describe()`) and says how many jobs it takes."""

    def __init__(
        self, stats: Callable[[], dict[str, Any]], kv_pages: int, max_num_seqs: int, max_concurrency: int
    ) -> None:
        self.stats = stats
        self.kv_pages = kv_pages
        self.bound = max(1, min(max_concurrency, max_num_seqs))
        self.pages_per_request: float | None = None
        self.preempting = False  # since the engine last preempted, it has held requests it has no room to run
        self._preemptions_seen = 0

    def limit(self, running_jobs: int) -> int:
        """How many jobs the worker should hold now, `running_jobs` of them already running."""
        stats = self.stats()
        requests = stats.get("requests_running", 0) + stats.get("requests_waiting", 0)
        if stats.get("preemptions", 0) > self._preemptions_seen:
            self.preempting = True
        self._preemptions_seen = stats.get("preemptions", 0)
        if not stats.get("requests_waiting", 0) or not running_jobs:
            self.preempting = False
        if self.preempting:
            return max(1, min(running_jobs, self.bound))
        used = self.kv_pages - stats["kv_pages_free"]
        if requests and used > 0:
            now = used / requests
            last = self.pages_per_request
            self.pages_per_request = now if last is None else last + SMOOTHING * (now - last)
            fits = running_jobs + int(stats["kv_pages_free"] / now)
        elif self.pages_per_request is not None:
            fits = int(self.kv_pages / self.pages_per_request)
        else:
            fits = self.bound
        return max(1, min(fits, self.bound))


def sdk_concurrency_modifier(gauge: ConcurrencyGauge) -> Callable[[int], int]:
    """The gauge as RunPod's `concurrency_modifier`.

    NOTE: the SDK (1.12) resizes its job queue only once every job it holds has finished, and takes no job
    meanwhile: a value that followed every step would starve the worker. So the value moves up only while the
    worker is idle, and down when the engine preempts (then the SDK's pause is the point: no job is taken until
    the running ones are done).
    """
    from runpod.serverless.modules.worker_state import JobsProgress

    progress = JobsProgress()

    def modifier(current: int) -> int:
        running = progress.get_job_count()
        target = gauge.limit(running)
        if running == 0 or (gauge.preempting and target < current):
            return target
        return current

    return modifier
