"""One engine request streamed as API events: the loop chat completions, Responses and Messages share.

Each API builds its own events (an `EventBuilder`); the driver owns their order and the request's life: the
engine request starts before the first event, so a bad request raises from the first `__anext__` instead of
streaming; closing the stream early aborts it; an error after streaming began is the API's own failure event
where it has one (or raises, for the caller to frame, where it has none).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Protocol

from engine.outputs import RequestOutput
from worker.openai.generation import start


class EventBuilder(Protocol):
    """An API's events for one streamed answer, asked for in order: opening, one batch per output, closing."""

    def opening(self, first: RequestOutput) -> list[dict[str, Any]]:
        """The events before any text (`first`: the request's first output, already arrived)."""
        ...

    def add(self, output: RequestOutput) -> list[dict[str, Any]]:
        """The events one engine output brings."""
        ...

    def closing(self) -> list[dict[str, Any]]:
        """The events after the last output: closing items, the final object, usage."""
        ...

    def failed(self, exc: Exception) -> list[dict[str, Any]] | None:
        """The events that end a stream which failed midway; None re-raises `exc`."""
        ...


async def stream_events(
    engine: Any,
    prompt_token_ids: list[int],
    params: Any,
    request_id: str,
    builder: EventBuilder,
    images: Callable[[], Awaitable[list[Any]]] | None = None,
) -> AsyncGenerator[dict[str, Any], None]:
    """Start the engine request, then yield `builder`'s events until the request ends or the stream is closed.
    images: reads the prompt's image files (fetching their URLs) before the request starts."""
    files = await images() if images is not None else None
    started = await start(engine, prompt_token_ids, params, request_id, files)
    try:
        for event in builder.opening(started.first):
            yield event
        async for output in started:
            for event in builder.add(output):
                yield event
        for event in builder.closing():
            yield event
    except Exception as exc:
        failure = builder.failed(exc)
        if failure is None:
            raise
        for event in failure:
            yield event
    finally:
        await started.aclose()


async def run_to_end(
    engine: Any,
    prompt_token_ids: list[int],
    params: Any,
    request_id: str,
    add: Callable[[RequestOutput], Any],
    images: Callable[[], Awaitable[list[Any]]] | None = None,
) -> None:
    """An answer asked for whole: every output of the request handed to `add` (its events unused); images as
    stream_events takes them."""
    files = await images() if images is not None else None
    started = await start(engine, prompt_token_ids, params, request_id, files)
    try:
        async for output in started:
            add(output)
    finally:
        await started.aclose()
