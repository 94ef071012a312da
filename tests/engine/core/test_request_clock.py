"""AsyncEngine tells its observer (the worker's metrics) each generation request's timing and token counts."""

from __future__ import annotations

import asyncio

import pytest

from engine.config import EngineConfig
from engine.core.async_engine import AsyncEngine
from engine.outputs import FinishedRequest
from engine.sample.params import SamplingParams


class Recorded:
    """A RequestObserver that keeps what it is told."""

    def __init__(self) -> None:
        self.first: list[float] = []
        self.next: list[float] = []
        self.done: list[FinishedRequest] = []

    def first_token(self, seconds: float) -> None:
        self.first.append(seconds)

    def next_tokens(self, seconds: float) -> None:
        self.next.append(seconds)

    def finished(self, request: FinishedRequest) -> None:
        self.done.append(request)


@pytest.fixture(scope="module")
def observed(baked_model_path):
    recorded = Recorded()
    config = EngineConfig(model_path=str(baked_model_path), dtype="float32", num_kv_pages=64, max_model_len=256)
    engine = AsyncEngine(config, observer=recorded)
    yield engine, recorded
    engine.shutdown()


def test_a_finished_request_is_timed_once_per_output(observed) -> None:
    engine, recorded = observed
    prompt = engine.tokenizer.encode("Once upon a time")
    params = SamplingParams(temperature=0.0, max_tokens=4, n=2, ignore_eos=True)

    async def run() -> int:
        return sum([1 async for out in engine.generate(prompt, params, "timed") if out.num_generated_tokens])

    outputs = asyncio.run(run())
    assert len(recorded.first) == 1 and len(recorded.next) == outputs - 1
    (request,) = recorded.done
    assert request.prompt_tokens == len(prompt) and request.generation_tokens == 8
    assert request.finish_reasons == ["length", "length"]
    assert request.seconds >= recorded.first[0] + sum(recorded.next) > 0


def test_a_stream_closed_early_counts_as_aborted(observed) -> None:
    engine, recorded = observed
    recorded.done.clear()
    prompt = engine.tokenizer.encode("The sea is")

    async def run() -> None:
        stream = engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True), "closed")
        await stream.__anext__()
        await stream.aclose()

    asyncio.run(run())
    (request,) = recorded.done
    assert request.finish_reasons == ["abort"] and request.prompt_tokens == len(prompt)
