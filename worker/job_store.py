"""Asynchronous jobs of the local endpoint (/run, /stream, /status, /cancel), run through the handler, and the
counts /health reports: every request the endpoint serves (jobs and OpenAI routes alike), by what it runs."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from worker.anthropic.errors import COUNT_TOKENS
from worker.jobs import (
    ADAPTER_ROUTES,
    COMPACT,
    EMBEDDINGS,
    GENERATIONS,
    MODELS,
    RESPONSES,
    SCORING,
    normalize_route,
)
from worker.openai.errors import BadRequest, WorkerBusy, error_body

Handler = Callable[[dict[str, Any]], AsyncGenerator[Any, None]]
# Routes counted under their own name; a route that carries an id is counted under its template, anything else as
# "unknown", so the counts stay a short list whatever clients send.
NAMED_ROUTES = frozenset({*GENERATIONS, *SCORING, *ADAPTER_ROUTES, COMPACT, EMBEDDINGS, MODELS, COUNT_TOKENS})
FINAL = {"COMPLETED", "FAILED", "CANCELLED"}
KEEP_FINISHED = 1000  # finished jobs remembered for /status; older ones are forgotten
# How often a job waiting for its turn looks at the engine again when no job has ended meanwhile (its free
# pages change with every step, which sends no event here).
RECHECK_S = 0.05


def is_error(output: Any) -> bool:
    """Whether the RunPod SDK would take this yield as the job's failure."""
    return isinstance(output, dict) and bool(output.get("error"))


def route_name(job_input: Any) -> str:
    """What a job (or an OpenAI-route request, as the job it becomes) is counted under: its OpenAI route with any id
    as a template (/v1/models/{model}), "native" for a native job."""
    if not isinstance(job_input, dict) or "openai_route" not in job_input:
        return "native"
    try:
        route = normalize_route(job_input["openai_route"])
    except BadRequest:
        return "unknown"
    if route in NAMED_ROUTES:
        return route
    if route.startswith(MODELS + "/"):
        return MODELS + "/{model}"
    if route.startswith(RESPONSES + "/"):
        return RESPONSES + "/{response_id}" + ("/input_items" if route.endswith("/input_items") else "")
    return "unknown"


@dataclass
class RouteCounts:
    """One route's requests: ended (completed, failed, cancelled) and running now."""

    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    in_progress: int = 0

    def report(self) -> dict[str, int]:
        return {
            "completed": self.completed,
            "failed": self.failed,
            "cancelled": self.cancelled,
            "inProgress": self.in_progress,
        }


@dataclass(kw_only=True)
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
        self.routes: dict[str, RouteCounts] = {}
        self.running = 0
        self.turn = asyncio.Condition()  # notified when a running job ends

    async def limited(
        self, job: dict[str, Any], started: Callable[[], None] | None = None
    ) -> AsyncGenerator[Any, None]:
        """The handler's outputs for `job` once the engine takes another job, as RunPod's SDK would take it (the
        turn is held until the outputs end or are closed); `started` is called when the turn is taken."""
        async with self.turn:
            while self.running >= self.limit(self.running):
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.turn.wait(), RECHECK_S)
            self.running += 1
        async with contextlib.aclosing(self._on_turn(job, started)) as outputs:
            async for output in outputs:
                yield output

    async def at_once(
        self, job: dict[str, Any], started: Callable[[], None] | None = None
    ) -> AsyncGenerator[Any, None]:
        """limited() without the wait: a job past the limit gets WorkerBusy's error at once (a load-balancing
        endpoint has no queue in front of it, and holding a request would only run it into RunPod's timeout)."""
        # NOTE: the limit is asked once (each ask feeds the gauge's smoothing), and the turn taken with no await
        # since, so no other job can take it in between.
        if self.running >= self.limit(self.running):
            yield error_body(WorkerBusy("The worker is running all the requests it can hold; retry shortly."))
            return
        self.running += 1
        async with contextlib.aclosing(self._on_turn(job, started)) as outputs:
            async for output in outputs:
                yield output

    async def _on_turn(self, job: dict[str, Any], started: Callable[[], None] | None) -> AsyncGenerator[Any, None]:
        """The handler's outputs for `job` on a turn already taken; the turn is given back when they end or are
        closed."""
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
        new = job.outputs[job.streamed :]
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

    def begin(self, route: str) -> Callable[[str], None]:
        """Count a request under `route` as in progress; the `end(status)` returned counts it as ended once, status
        "completed", "failed" or "cancelled"."""
        counts = self.routes.setdefault(route, RouteCounts())
        counts.in_progress += 1
        ended = False

        def end(status: str) -> None:
            nonlocal ended
            if not ended:
                ended = True
                counts.in_progress -= 1
                setattr(counts, status, getattr(counts, status) + 1)

        return end

    def health(self) -> dict[str, Any]:
        """RunPod's job counts over every request served (/run jobs and OpenAI routes alike), and the same by route."""
        routes = self.routes.values()
        queued = sum(1 for j in self.jobs.values() if j.status == "IN_QUEUE")
        return {
            "completed": sum(c.completed for c in routes),
            "failed": sum(c.failed for c in routes),
            "inProgress": sum(c.in_progress for c in routes),
            "inQueue": queued,
            "retried": 0,
        }  # RunPod's field; this endpoint never retries a job

    def by_route(self) -> dict[str, dict[str, int]]:
        return {route: counts.report() for route, counts in sorted(self.routes.items())}

    async def _run(self, job: Job) -> None:
        route = route_name(job.input)
        end: Callable[[str], None] | None = None
        try:

            def start() -> None:
                nonlocal end
                job.status = "IN_PROGRESS"
                end = self.begin(route)

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
            (end or self.begin(route))(job.status.lower())  # a job cancelled in the queue never started
            await job.notify()

    def _forget_old(self) -> None:
        finished = [j.id for j in self.jobs.values() if j.status in FINAL]
        for job_id in finished[: max(0, len(finished) - KEEP_FINISHED)]:
            del self.jobs[job_id]
