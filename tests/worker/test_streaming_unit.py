"""SSE framing and RunPod's growing stream batches."""

from __future__ import annotations

import asyncio
import json

from worker.openai.streaming import SSE_DONE, BatchSize, grouped, openai_stream, sse


async def _items(n: int):
    for i in range(n):
        yield {"i": i}


def _collect(agen) -> list:
    async def run():
        return [x async for x in agen]

    return asyncio.run(run())


def test_batch_sizes_grow_from_min_by_factor_up_to_max() -> None:
    sizes = BatchSize(50, 1, 3)
    seen = []
    for _ in range(6):
        seen.append(sizes.size)
        sizes.grow()
    assert seen == [1, 3, 9, 27, 50, 50]
    fixed = BatchSize(50, 1, 1)  # no growth factor: always the maximum, as in RunPod's vLLM worker
    assert fixed.size == 50


def test_grouped_follows_the_sizes_and_flushes_the_rest() -> None:
    groups = _collect(grouped(_items(20), BatchSize(8, 2, 2)))
    assert [len(g) for g in groups] == [2, 4, 8, 6]
    assert [x["i"] for g in groups for x in g] == list(range(20))


def test_raw_stream_is_sse_text_ending_in_done() -> None:
    out = _collect(openai_stream(_items(3), raw=True, sizes=BatchSize(2, 1, 2)))
    assert all(isinstance(o, str) for o in out)
    text = "".join(out)
    assert text.endswith(SSE_DONE)
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert [json.loads(e) for e in events[:-1]] == [{"i": 0}, {"i": 1}, {"i": 2}]


def test_non_raw_stream_is_lists_of_chunk_objects_without_done() -> None:
    out = _collect(openai_stream(_items(5), raw=False, sizes=BatchSize(50, 1, 3)))
    assert out == [[{"i": 0}], [{"i": 1}, {"i": 2}, {"i": 3}], [{"i": 4}]]


def test_an_error_mid_stream_becomes_an_error_event_then_done() -> None:
    async def failing():
        yield {"i": 0}
        raise RuntimeError("boom")

    text = "".join(_collect(openai_stream(failing(), raw=True, sizes=BatchSize(50))))
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "boom" not in error["message"]


def test_sse_frames_one_json_object() -> None:
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n'


def test_closing_the_stream_early_closes_the_chunk_source() -> None:
    closed = []

    async def source():
        try:
            for i in range(100):
                yield {"i": i}
        finally:
            closed.append(True)  # where the engine request would be aborted

    async def run():
        stream = openai_stream(source(), raw=True, sizes=BatchSize(50, 1, 3))
        first = await stream.__anext__()
        await stream.aclose()
        assert closed == [True]  # now, not when the loop shuts down and collects what was left open
        return first

    assert asyncio.run(run()).startswith("data: ")
