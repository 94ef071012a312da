"""Server-sent events and the RunPod batching of stream outputs.

A RunPod job streams by yielding; each yield is one HTTP round trip for the platform, so chunks are
grouped: the first group holds `min` chunks and each next one `growth` times more, up to `max`
(RunPod's vLLM worker's DEFAULT_MIN_BATCH_SIZE / GROWTH_FACTOR / BATCH_SIZE). With RAW_OPENAI_OUTPUT
a group is the SSE text of its chunks; without, a list of chunk objects.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any

from worker.openai.errors import error_body

SSE_DONE = "data: [DONE]\n\n"


def sse(obj: Any, event: str | None = None) -> str:
    """One server-sent event carrying `obj` as JSON, named `event` when given (the Responses API names them)."""
    data = f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"
    return f"event: {event}\n{data}" if event else data


def sse_event(obj: Any) -> str:
    """A Responses or Messages API event as SSE: named by its `type` (an OpenAI error body is named `error`)."""
    return sse(obj, obj.get("type", "error") if isinstance(obj, dict) else None)


class BatchSize:
    """How many items the next yield holds: starts at `minimum`, grows by `growth` up to `maximum`."""

    def __init__(self, maximum: int, minimum: int = 1, growth: float = 1.0) -> None:
        self.maximum = max(1, int(maximum))
        self.growing = growth > 1 and 1 <= minimum < self.maximum
        self.growth = growth
        self.current = float(minimum if self.growing else self.maximum)

    @property
    def size(self) -> int:
        return int(self.current)

    def grow(self) -> None:
        if self.growing:
            self.current = min(self.current * self.growth, self.maximum)


async def grouped(items: AsyncGenerator[Any, None], sizes: BatchSize) -> AsyncGenerator[list[Any], None]:
    """`items` in lists sized by `sizes`; the last list may be shorter."""
    batch: list[Any] = []
    async with aclosing(items):  # closing a stream early must reach the engine request under it
        async for item in items:
            batch.append(item)
            if len(batch) >= sizes.size:
                yield batch
                batch = []
                sizes.grow()
    if batch:
        yield batch


async def openai_stream(
    chunks: AsyncGenerator[dict[str, Any], None],
    raw: bool,
    sizes: BatchSize,
    events: bool = False,
    error: Callable[[BaseException], dict[str, Any]] = error_body,
) -> AsyncGenerator[Any, None]:
    """Chunk objects as a job yields them: SSE text ending in [DONE] when `raw`, else lists of chunks.

    `events`: named events (the Responses and Messages APIs'), which end without [DONE]. An error after
    streaming began cannot change the status any more; it goes out as an SSE error event (or an error
    object in the list, written by `error`), the way vLLM ends a failed stream.
    """
    encode = sse_event if events else sse

    async def items() -> AsyncGenerator[Any, None]:
        try:
            async with aclosing(chunks):
                async for chunk in chunks:
                    yield encode(chunk) if raw else chunk
        except Exception as exc:
            body = error(exc)
            yield encode(body) if raw else body
        if raw and not events:
            yield SSE_DONE

    async with aclosing(grouped(items(), sizes)) as batches:
        async for batch in batches:
            yield "".join(batch) if raw else batch
