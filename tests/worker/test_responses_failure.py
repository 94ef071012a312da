"""A Responses stream that fails midway ends with a `response.failed` event, not a dropped stream.

In process, through the real job layer and engine on the baked model, with a fault injected into the
sampler for one request once it has streamed some text (as tests/engine/core/test_async_engine.py does).
"""

from __future__ import annotations

import asyncio

import pytest
from openai_schema import parse_events, validate

from engine.config import EngineConfig
from engine.core.async_engine import AsyncEngine
from engine.sample.sampler import Sampler
from worker.jobs import run_job
from worker.openai.responses.store import ResponseStore
from worker.runtime import Runtime
from worker.settings import baked_model_name, load_settings
from worker.shutdown import Drain

DOOMED_MAX_TOKENS = 9  # marks the request whose sampling fails


@pytest.fixture(scope="module")
def runtime(baked_model_path):
    settings = load_settings({"MODEL_PATH": str(baked_model_path)})
    engine = AsyncEngine(
        EngineConfig(
            model_path=str(baked_model_path), dtype="float32", num_kv_pages=64, max_model_len=512, max_num_seqs=8
        )
    )
    yield Runtime(
        settings=settings,
        engine=engine,
        model_names=[baked_model_name(str(baked_model_path))],
        created=0,
        responses=ResponseStore(16, 2**20),
        drain=Drain(engine, 1.0),
    )
    engine.shutdown()


def _job(runtime: Runtime, max_tokens: int) -> dict:
    body = {
        "model": runtime.served_model_name,
        "input": "Tell me a story.",
        "max_output_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    return {"id": "j", "input": {"openai_route": "/v1/responses", "openai_input": body}}


async def _events(runtime: Runtime, max_tokens: int) -> list[dict]:
    return parse_events("".join([out async for out in run_job(_job(runtime, max_tokens), runtime)]))


def test_a_failure_midway_is_a_failed_event_and_the_worker_goes_on(runtime, monkeypatch) -> None:
    real = Sampler.__call__
    calls = {"doomed": 0}

    def flaky(self, logits, rows):
        if any(r.params.max_tokens == DOOMED_MAX_TOKENS for r in rows):
            calls["doomed"] += 1
            if calls["doomed"] > 3:
                raise ValueError("injected")
        return real(self, logits, rows)

    monkeypatch.setattr(Sampler, "__call__", flaky)
    events = [validate(e) for e in asyncio.run(_events(runtime, DOOMED_MAX_TOKENS))]
    kinds = [e["type"] for e in events]
    assert "response.output_text.delta" in kinds and kinds[-1] == "response.failed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert runtime.responses.get(failed["id"]).response["status"] == "failed"
    after = asyncio.run(_events(runtime, 4))
    assert after[-1]["type"] == "response.incomplete" and after[-1]["response"]["usage"]["output_tokens"] == 4
