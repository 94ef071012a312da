"""Asynchronous jobs of the local endpoint (/run, /stream, /status, /cancel), run through the handler."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

Handler = Callable[[dict[str, Any]], AsyncIterator[Any]]
FINAL = {"COMPLETED", "FAILED", "CANCELLED"}
KEEP_FINISHED = 1000  # finished jobs remembered for /status; older ones are forgotten
# How often a job waiting for its turn looks at the engine again when no job has ended meanwhile (its free
# pages change with every step, which sends no event here).
RECHECK_S = 0.05


def is_error(output: Any) -> bool:
    """Whether the RunPod SDK would take this yield as the job's failure."""
    return isinstance(output, dict) and bool(output.get("error"))


@dataclass
class Job:
    """One job: its outputs so far, its status and how far /stream has read."""

    id: str
    input: Any
    status: str = "IN_QUEUE"
    outputs: list[Any] = field(default_factory=list)
    error: Any = None
    streamed: int = 0
    task: asyncio.Task | None = None
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    def result(self) -> dict[str, Any]:
        """What /status and /runsync answer."""
        out: dict[str, Any] = {"id": self.id, "status": self.status}
        if self.status == "COMPLETED":
            out["output"] = self.outputs
        if self.error is not None:
            out["error"] = self.error
        return out


class JobStore:
    """The jobs of one local endpoint, each run as a task through the production handler."""

    def __init__(self, handler: Handler, limit: Callable[[int], int]) -> None:
        """`limit(running)`: how many jobs may run now, `running` of them running (worker/concurrency.py)."""
        self.handler = handler
        self.limit = limit
        self.jobs: OrderedDict[str, Job] = OrderedDict()
        self.counts = {"completed": 0, "failed": 0, "cancelled": 0}
        self.running = 0
        self.turn = asyncio.Condition()  # notified when a running job ends

    async def limited(self, job: dict[str, Any], started: Callable[[], None] | None = None) -> AsyncIterator[Any]:
        """The handler's outputs for `job` once the engine takes another job, as RunPod's SDK would take it (the
        turn is held until the outputs end or are closed); `started` is called when the turn is taken."""
        async with self.turn:
            while self.running >= self.limit(self.running):
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.turn.wait(), RECHECK_S)
            self.running += 1
        try:
            if started is not None:
                started()
            async with contextlib.aclosing(self.handler(job)) as outputs:
                async for output in outputs:
                    yield output
        finally:
            self.running -= 1
            async with self.turn:
                self.turn.notify_all()

    def submit(self, job_input: Any) -> Job:
        job = Job(id=f"local-{uuid.uuid4().hex}", input=job_input)
        self.jobs[job.id] = job
        job.task = asyncio.ensure_future(self._run(job))
        self._forget_old()
        return job

    def get(self, job_id: str) -> Job | None:
        return self.jobs.get(job_id)

    async def wait(self, job: Job) -> dict[str, Any]:
        if job.task is not None:
            await asyncio.shield(job.task)
        return job.result()

    async def stream(self, job: Job, timeout: float = 30.0) -> dict[str, Any]:
        """Outputs not yet streamed, waiting up to `timeout` for one when there is none and the job runs."""
        async with job.changed:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(
                    job.changed.wait_for(lambda: job.streamed < len(job.outputs) or job.status in FINAL), timeout
                )
        new = job.outputs[job.streamed:]
        job.streamed += len(new)
        out: dict[str, Any] = {"id": job.id, "status": job.status, "stream": [{"output": o} for o in new]}
        if job.error is not None:
            out["error"] = job.error
        return out

    async def cancel(self, job: Job) -> dict[str, Any]:
        if job.task is not None and not job.task.done():
            job.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await job.task
        return {"id": job.id, "status": job.status}

    def health(self) -> dict[str, Any]:
        running = sum(1 for j in self.jobs.values() if j.status == "IN_PROGRESS")
        queued = sum(1 for j in self.jobs.values() if j.status == "IN_QUEUE")
        return {"completed": self.counts["completed"], "failed": self.counts["failed"], "inProgress": running,
                "inQueue": queued, "retried": 0}  # RunPod's field; this endpoint never retries a job

    async def _run(self, job: Job) -> None:
        try:
            def start() -> None:
                job.status = "IN_PROGRESS"

            async with contextlib.aclosing(self.limited({"id": job.id, "input": job.input}, start)) as outputs:
                async for output in outputs:
                    if is_error(output):
                        job.status, job.error = "FAILED", output["error"]
                        break
                    job.outputs.append(output)
                    await job.notify()
            if job.status != "FAILED":
                job.status = "COMPLETED"
        except asyncio.CancelledError:
            job.status = "CANCELLED"
        except Exception as exc:  # the handler itself crashed; the SDK reports such jobs as failed too
            job.status, job.error = "FAILED", f"{type(exc).__name__}: {exc}"
        finally:
            self.counts[job.status.lower()] = self.counts.get(job.status.lower(), 0) + 1
            await job.notify()

    def _forget_old(self) -> None:
        finished = [j.id for j in self.jobs.values() if j.status in FINAL]
        for job_id in finished[: max(0, len(finished) - KEEP_FINISHED)]:
            del self.jobs[job_id]
