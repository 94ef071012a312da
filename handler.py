"""RunPod Serverless entry point: one async generator handler over the in-process engine.

    python handler.py                       on RunPod (RUNPOD_WEBHOOK_GET_JOB set): the serverless worker loop;
                                            on a load-balancing endpoint (PORT set): the worker's HTTP server
                                            (worker/load_balancer.py)
    python handler.py --test_input '<json>' run one job locally (test_input.json when no JSON is given, or
                                            when started outside RunPod), print each output and the aggregate
    python handler.py --serve [--host H] [--port P]
                                            a local endpoint with RunPod's URL layout (see worker/server.py)

Settings come from the environment (worker/settings.py). Slow imports (runpod probes the CPU for a
second, torch takes one) are deferred or overlapped with loading the model, and transformers is not
imported at all to serve a bake, since cold start is what a serverless worker pays on every scale-up. The
start-up log gives each phase in milliseconds, counted from the process's start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any


def _process_age_s() -> float:
    """Seconds since this process started (Linux /proc), so start-up figures include the interpreter's own start."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        return max(0.0, float(Path("/proc/uptime").read_text().split()[0]) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


STARTED_AT = time.perf_counter() - _process_age_s()
PYTHON_MS = round(1000 * (time.perf_counter() - STARTED_AT))  # the interpreter's start and this module's imports
log = logging.getLogger("worker")
_first_output = threading.Event()


def _log_first_output() -> None:
    if not _first_output.is_set():
        _first_output.set()
        log.info("first output %.2f s after the process started", time.perf_counter() - STARTED_AT)


async def handler(job: dict[str, Any]) -> AsyncGenerator[Any, None]:
    """The production handler: every route of the local endpoint goes through it too."""
    from worker.jobs import close_when_cancelled, run_job
    from worker.openai.errors import error_body
    from worker.runtime import current

    runtime = current()
    runtime.drain.watch_sigterm()
    if runtime.drain.draining:  # SIGTERM came: the jobs already running finish, no new one starts
        from engine.errors import ShuttingDown

        yield error_body(ShuttingDown("The worker is shutting down; send the request again."))
        return
    outputs = run_job(job, runtime)
    close_when_cancelled(outputs)
    async for output in outputs:
        _log_first_output()
        yield output


async def run_test_job(job_input: Any) -> int:
    """Run one job through `handler`, print each output and the aggregate as JSON; 1 on an error."""
    from worker.job_store import is_error

    job = {"id": "local-test", "input": job_input}
    outputs = []
    async for output in handler(job):
        print(json.dumps({"output": output}, ensure_ascii=False), flush=True)
        if is_error(output):
            print(json.dumps({"id": job["id"], "status": "FAILED", "error": output["error"]}), flush=True)
            return 1
        outputs.append(output)
    print(json.dumps({"id": job["id"], "status": "COMPLETED", "output": outputs}, ensure_ascii=False), flush=True)
    return 0


def _load_test_input(value: str | None) -> Any:
    """The job input: `--test_input` JSON, either a whole job as RunPod's SDK takes it (`{"input": {...}}`) or
    the input alone; without a value, test_input.json's `input`."""
    if value:
        given = json.loads(value)
        return given["input"] if isinstance(given, dict) and "input" in given else given
    for folder in (Path.cwd(), Path(__file__).resolve().parent):
        path = folder / "test_input.json"
        if path.is_file():
            return json.loads(path.read_text())["input"]
    raise FileNotFoundError("no --test_input JSON given and no test_input.json found")


def _import_in_background(*modules: str) -> threading.Thread:
    """Import `modules` on a thread while the model loads (their import time is mostly I/O and subprocesses)."""
    import importlib

    thread = threading.Thread(target=lambda: [importlib.import_module(m) for m in modules], daemon=True)
    thread.start()
    return thread


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--test_input", nargs="?", const="", default=None, help="a job input as JSON")
    parser.add_argument("--serve", action="store_true", help="run the local HTTP endpoint")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)

    from engine.timing import timed

    phases = {"python": PYTHON_MS}
    with timed(phases, "settings"):
        from worker.settings import SettingsError, load_settings

        try:
            settings = load_settings()
        except SettingsError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    logging.basicConfig(
        level=settings.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    def start() -> bool:
        """Build the engine; a model that cannot be served is one line on stderr, not a traceback."""
        with timed(phases, "imports"):  # torch, the engine and the worker's modules
            from engine.core.async_engine import AsyncEngine  # noqa: F401
            from engine.errors import EngineError
            from worker import runtime
            from worker.jobs import run_job  # noqa: F401
        try:
            started = runtime.start(settings)
        except EngineError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return False
        phases.update(started.engine.start_ms)
        log.info(
            "start-up in ms: %s; ready %.2f s after the process started",
            ", ".join(f"{name} {ms}" for name, ms in phases.items()),
            time.perf_counter() - STARTED_AT,
        )
        return True

    from worker.load_balancer import endpoint_type

    endpoint = "queue" if "--rp_serve_api" in rest else endpoint_type(settings)
    if args.serve:
        imports = _import_in_background("uvicorn", "fastapi", "worker.server")
        if not start():
            return 2
        imports.join()
        from worker.server import serve

        serve(handler, settings, host=args.host, port=args.port)
        return 0
    if args.test_input is not None or endpoint == "local":
        try:
            job_input = _load_test_input(args.test_input)
        except (OSError, ValueError, KeyError) as exc:
            print(f"error: bad test input: {exc}", file=sys.stderr)
            return 2
        if not start():
            return 2
        return asyncio.run(run_test_job(job_input))

    if endpoint == "load_balancer":
        _import_in_background("fastapi", "worker.server")
        from worker.load_balancer import serve_load_balancer

        return serve_load_balancer(start, handler, settings)
    imports = _import_in_background("runpod")
    if not start():
        return 2
    imports.join()
    import runpod

    from worker.concurrency import sdk_concurrency_modifier
    from worker.fitness import register_fitness_checks
    from worker.runtime import current

    register_fitness_checks(current())
    sys.argv = [sys.argv[0], *rest]
    runpod.serverless.start(
        {
            "handler": handler,
            "return_aggregate_stream": True,
            "concurrency_modifier": sdk_concurrency_modifier(current().concurrency),
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
