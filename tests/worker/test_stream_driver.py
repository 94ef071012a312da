"""The stream driver the chat, Responses and Messages streams share: event order, failures, aborts."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from worker.openai.stream_driver import run_to_end, stream_events


class _Engine:
    """Yields the given outputs (raising any that is an exception) and records whether its request was closed."""

    def __init__(self, outputs: list[Any]) -> None:
        self.outputs = outputs
        self.closed = False

    def generate(self, prompt_token_ids: list[int], params: Any, request_id: str):
        async def outputs():
            try:
                for output in self.outputs:
                    if isinstance(output, BaseException):
                        raise output
                    yield output
            finally:
                self.closed = True

        return outputs()


class _Builder:
    def __init__(self, fails: bool = True) -> None:
        self.fails = fails

    def opening(self, first: Any) -> list[dict[str, Any]]:
        return [{"type": "open", "first": first}]

    def add(self, output: Any) -> list[dict[str, Any]]:
        return [{"type": "delta", "output": output}]

    def closing(self) -> list[dict[str, Any]]:
        return [{"type": "close"}]

    def failed(self, exc: Exception) -> list[dict[str, Any]] | None:
        return [{"type": "failed", "error": str(exc)}] if self.fails else None


def _run(engine: _Engine, builder: _Builder, take: int | None = None) -> list[dict[str, Any]]:
    async def run() -> list[dict[str, Any]]:
        events = stream_events(engine, [1], None, "r", builder)
        out = []
        async for event in events:
            out.append(event)
            if take is not None and len(out) == take:
                await events.aclose()
                break
        return out

    return asyncio.run(run())


def test_events_come_opening_then_one_batch_per_output_then_closing() -> None:
    engine = _Engine(["a", "b"])
    events = _run(engine, _Builder())
    assert [e["type"] for e in events] == ["open", "delta", "delta", "close"]
    assert events[0]["first"] == "a" and [e["output"] for e in events[1:3]] == ["a", "b"]
    assert engine.closed


def test_a_bad_request_raises_from_the_first_event_instead_of_streaming() -> None:
    engine = _Engine([ValueError("too long")])
    with pytest.raises(ValueError, match="too long"):
        _run(engine, _Builder())
    assert engine.closed


def test_a_failure_midway_is_the_builders_failure_event_or_raises_without_one() -> None:
    events = _run(_Engine(["a", RuntimeError("boom")]), _Builder())
    assert [e["type"] for e in events] == ["open", "delta", "failed"] and events[-1]["error"] == "boom"
    engine = _Engine(["a", RuntimeError("boom")])
    with pytest.raises(RuntimeError, match="boom"):
        _run(engine, _Builder(fails=False))
    assert engine.closed


def test_closing_the_stream_early_closes_the_engine_request() -> None:
    engine = _Engine(["a", "b", "c"])
    assert [e["type"] for e in _run(engine, _Builder(), take=2)] == ["open", "delta"]
    assert engine.closed


def test_run_to_end_hands_every_output_to_add_and_closes() -> None:
    engine = _Engine(["a", "b"])
    seen: list[Any] = []
    asyncio.run(run_to_end(engine, [1], None, "r", seen.append))
    assert seen == ["a", "b"] and engine.closed
