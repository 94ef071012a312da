"""RunPod stops one job: its engine request is aborted and its pages freed, the other jobs carry on.

In process, through the RunPod SDK's own job loop (`JobScaler`: job take, `handle_job`, result upload and
its stop channel) over `handler.py`'s handler and the baked model. The SDK's uploads go to a real local
HTTP sink, which holds job A's first streamed upload open: the SDK stops A while it waits on that upload,
so A's generators sit suspended at a yield, the case where no CancelledError reaches them.
"""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from aiohttp import web

import worker.runtime
from engine.config import EngineConfig
from engine.core.async_engine import AsyncEngine
from worker.openai.responses.store import ResponseStore
from worker.runtime import Runtime
from worker.settings import baked_model_name, load_settings
from worker.shutdown import Drain

STOPPED_MAX_TOKENS = 480  # job A alone would decode this many: far more than it gets before its stop
OTHER_MAX_TOKENS = 24
# Only a request that is never aborted reaches it: the abort lands on the engine's next step.
IDLE_GUARD_S = 120.0


@pytest.fixture
def runtime(baked_model_path, monkeypatch):
    settings = load_settings({"MODEL_PATH": str(baked_model_path)})
    engine = AsyncEngine(
        EngineConfig(
            model_path=str(baked_model_path),
            dtype="float32",
            num_kv_pages=96,
            max_model_len=512,
            max_num_seqs=8,
            enable_prefix_caching=False,
        )
    )
    rt = Runtime(
        settings=settings,
        engine=engine,
        model_names=[baked_model_name(str(baked_model_path))],
        created=0,
        responses=ResponseStore(16, 2**20),
        drain=Drain(engine, 1.0),
    )
    monkeypatch.setattr(worker.runtime, "_current", rt)
    yield rt
    engine.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _native(max_tokens: int, stream: bool) -> dict:
    return {
        "prompt": "Once upon a time",
        "stream": stream,
        "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0},
    }


async def _wait_idle(engine: AsyncEngine, timeout_s: float) -> bool:
    """Whether the engine holds no request (no open stream, nothing unfinished) within `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while engine.num_running or engine.engine.has_unfinished():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def _scenario(rt: Runtime, monkeypatch) -> dict:
    from runpod.serverless.modules import rp_http
    from runpod.serverless.modules.rp_scale import JobScaler

    from handler import handler

    a_uploading, shutdown = asyncio.Event(), asyncio.Event()
    done: dict[str, dict] = {}
    b_done = asyncio.Event()

    async def stream_upload(request: web.Request) -> web.Response:
        if request.match_info["job"] == "A":
            a_uploading.set()
            await shutdown.wait()  # held open: the SDK is still waiting on it when it stops A
        return web.Response(text="ok")

    async def done_upload(request: web.Request) -> web.Response:
        done[request.match_info["job"]] = json.loads(await request.text())
        if request.match_info["job"] == "B":
            b_done.set()
        return web.Response(text="ok")

    app = web.Application()
    app.add_routes([web.post("/stream/{job}", stream_upload), web.post("/done/{job}", done_upload)])
    runner = web.AppRunner(app)
    await runner.setup()
    port = _free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    # The URLs RunPod gives a worker in RUNPOD_WEBHOOK_POST_STREAM / _POST_OUTPUT, read when the SDK is imported.
    monkeypatch.setattr(rp_http, "JOB_STREAM_URL", f"http://127.0.0.1:{port}/stream/$ID?gpu=test")
    monkeypatch.setattr(rp_http, "JOB_DONE_URL", f"http://127.0.0.1:{port}/done/$ID?gpu=test")

    jobs = [
        {"id": "A", "input": _native(STOPPED_MAX_TOKENS, True)},
        {"id": "B", "input": _native(OTHER_MAX_TOKENS, False)},
    ]

    async def take_jobs(session, count: int) -> list[dict]:
        if jobs:
            taken = jobs[:count]
            del jobs[:count]
            return taken
        await shutdown.wait()
        return []

    stop_sent = False

    async def stop_signals(session) -> list[str]:
        nonlocal stop_sent
        if not stop_sent:
            await a_uploading.wait()
            stop_sent = True
            return ["A"]
        await shutdown.wait()
        return []

    scaler = JobScaler(
        {
            "handler": handler,
            "return_aggregate_stream": True,
            "concurrency_modifier": lambda c: 4,
            "jobs_fetcher": take_jobs,
            "stop_signals_fetcher": stop_signals,
        }
    )
    loops = asyncio.create_task(scaler.run())
    await a_uploading.wait()
    task_a = scaler.jobs_tasks["A"]
    await asyncio.wait({task_a})
    engine = rt.engine
    await b_done.wait()
    # Unclosed, A's stream would stay open for good: the guard turns that into a failure, not a hang.
    idle = await _wait_idle(engine, IDLE_GUARD_S)
    stats = {
        **engine.stats(),
        "idle": idle,
        "kv_pages": engine.describe()["kv_pages"],
        "a_cancelled": task_a.cancelled(),
    }
    scaler.kill_worker()
    shutdown.set()
    await loops
    await runner.cleanup()
    return {"stats": stats, "done": done}


def test_a_stopped_job_is_aborted_and_its_pages_freed_while_another_finishes(runtime, monkeypatch) -> None:
    result = asyncio.run(_scenario(runtime, monkeypatch))
    stats, done = result["stats"], result["done"]
    assert stats["idle"], "job A's engine request was still open after the SDK stopped it"
    assert stats["a_cancelled"]  # the CancelledError went through the handler to the SDK's task
    assert stats["kv_pages_free"] == stats["kv_pages"]
    # A's request ended by its abort, long before its length: far fewer tokens than it alone would have run.
    prompt_tokens = len(runtime.tokenizer.encode("Once upon a time"))
    assert stats["tokens_run"] < STOPPED_MAX_TOKENS, stats
    assert "A" not in done  # a stopped job sends no result
    outputs = done["B"]["output"]
    assert done["B"].get("error") is None
    assert outputs[0]["usage"] == {"input": prompt_tokens, "output": OTHER_MAX_TOKENS}
