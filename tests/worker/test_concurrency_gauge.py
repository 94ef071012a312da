"""The jobs a worker takes follow its KV cache: the rule of worker/concurrency.py on the engine's stats, and the
same rule as RunPod's SDK sees it through its concurrency_modifier and its own job count."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import pytest

from worker.concurrency import SMOOTHING, ConcurrencyGauge, sdk_concurrency_modifier
from worker.job_store import JobStore

PAGES = 100


class Readings:
    """The engine's stats (the keys `LLMEngine.stats()` gives) as a test sets them, read by the gauge."""

    def __init__(self) -> None:
        self.now = {"kv_pages_free": PAGES, "preemptions": 0, "requests_running": 0, "requests_waiting": 0}

    def set(self, **values: int) -> None:
        self.now = {**self.now, **values}

    def __call__(self) -> dict:
        return dict(self.now)


def test_idle_it_takes_the_bound_then_what_the_free_pages_hold_at_the_measured_size() -> None:
    stats = Readings()
    assert ConcurrencyGauge(stats, PAGES, max_num_seqs=256, max_concurrency=300).limit(0) == 256
    gauge = ConcurrencyGauge(stats, PAGES, max_num_seqs=256, max_concurrency=64)
    assert gauge.limit(0) == 64
    stats.set(kv_pages_free=60, requests_running=4)  # 4 requests hold 10 pages each: 6 more fit
    assert gauge.limit(4) == 10
    stats.set(kv_pages_free=0, requests_running=4)  # full at 25 pages each: none more
    assert gauge.limit(4) == 4
    stats.set(kv_pages_free=PAGES, requests_running=0)  # idle again: the pool over what a request was seen to hold
    assert 4 <= gauge.limit(0) < 10


def test_while_it_preempts_it_takes_no_more_than_run_now() -> None:
    stats = Readings()
    gauge = ConcurrencyGauge(stats, PAGES, max_num_seqs=256, max_concurrency=256)
    stats.set(kv_pages_free=50, requests_running=5)
    assert gauge.limit(5) == 10
    stats.set(kv_pages_free=2, requests_running=6, requests_waiting=2, preemptions=1)
    assert gauge.limit(8) == 8 and gauge.preempting
    stats.set(kv_pages_free=30, requests_running=6, requests_waiting=2)  # still a backlog, no new preemption
    assert gauge.limit(8) == 8
    stats.set(kv_pages_free=30, requests_running=7, requests_waiting=0)  # the backlog runs: pages decide again
    assert gauge.limit(7) > 7 and not gauge.preempting
    stats.set(kv_pages_free=30, requests_running=7, requests_waiting=1)  # a new request waits, nothing preempted
    assert gauge.limit(7) > 7


@pytest.fixture
def sdk_jobs() -> Iterator[list[dict]]:
    """Jobs put into the SDK's own in-progress count (JobsProgress, a process-wide singleton)."""
    from runpod.serverless.modules.worker_state import JobsProgress

    held: list[dict] = []
    yield held
    for job in held:
        JobsProgress().remove(job)


def test_the_sdk_sees_a_new_value_only_when_idle_or_preempting(sdk_jobs) -> None:
    from runpod.serverless.modules.worker_state import JobsProgress

    stats = Readings()
    modifier = sdk_concurrency_modifier(ConcurrencyGauge(stats, PAGES, max_num_seqs=256, max_concurrency=64))
    assert modifier(1) == 64  # idle: the SDK may resize its queue at once
    for i in range(4):
        sdk_jobs.append({"id": f"job-{i}"})
        JobsProgress().add(sdk_jobs[-1])
    stats.set(kv_pages_free=60, requests_running=4)
    # The gauge says 10, but the SDK would stop taking jobs until these four end to resize: it keeps 64.
    assert modifier(64) == 64
    stats.set(kv_pages_free=0, requests_running=3, requests_waiting=1, preemptions=1)
    assert modifier(64) == 4  # preempting: the SDK takes no job until the running ones are done


def test_the_local_endpoint_feeds_the_gauge_one_sample_per_request_it_takes_at_once() -> None:
    stats = Readings()
    gauge = ConcurrencyGauge(stats, PAGES, max_num_seqs=256, max_concurrency=64)
    stats.set(kv_pages_free=60, requests_running=4)
    assert gauge.limit(4) == 10  # measured: 10 pages a request
    stats.set(kv_pages_free=20, requests_running=4)  # now 20 a request: one sample moves the average a step

    async def handler(job: dict[str, Any]) -> AsyncGenerator[Any, None]:
        yield {"echo": job["input"]}

    async def refused_or_run() -> list[Any]:
        store = JobStore(handler, gauge.limit)
        return [output async for output in store.at_once({"input": "hello"})]

    assert asyncio.run(refused_or_run()) == [{"echo": "hello"}]
    assert gauge.pages_per_request == pytest.approx(10 + SMOOTHING * (20 - 10))
