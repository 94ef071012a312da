"""Driving engine requests from the worker: start (errors surface first), merge, and collect deltas."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput


def response_id(prefix: str, request_id: str | None) -> str:
    """`chatcmpl-<request_id>` / `cmpl-<request_id>`, as vLLM names responses; a random id when none was given."""
    return f"{prefix}-{request_id or uuid.uuid4().hex}"


def engine_request_id(response_id: str) -> str:
    """Unique inside the engine even when clients reuse a request_id."""
    return f"{response_id}-{uuid.uuid4().hex[:8]}"


class Started:
    """An engine request whose first output has arrived: ContextTooLong and the like were raised already."""

    def __init__(self, first: RequestOutput, rest: AsyncIterator[RequestOutput]) -> None:
        self.first = first
        self._rest = rest

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        yield self.first
        async for output in self._rest:
            yield output

    async def aclose(self) -> None:
        """Abort the engine request if it is still running (closing the engine's iterator does that)."""
        close = getattr(self._rest, "aclose", None)
        if close is not None:
            await close()


async def start(
    engine: Any, prompt_token_ids: list[int], params: Any, request_id: str, images: list[Any] | None = None
) -> Started:
    """Submit one request and wait for its first output, so a bad request fails before any response. images: the
    prompt's engine.inputs.ImageData, in order."""
    outputs = (
        engine.generate(prompt_token_ids, params, request_id, images)
        if images
        else engine.generate(prompt_token_ids, params, request_id)
    )
    try:
        first = await outputs.__anext__()
    except BaseException:
        close = getattr(outputs, "aclose", None)
        if close is not None:
            await close()
        raise
    return Started(first, outputs)


async def start_all(engine: Any, prompts: list[list[int]], params: Any, request_id: str) -> list[Started]:
    """Start one request per prompt; if any fails, abort the others and raise the first failure."""
    if len(prompts) == 1:
        return [await start(engine, prompts[0], params, request_id)]
    results = await asyncio.gather(
        *(start(engine, ids, params, f"{request_id}-{i}") for i, ids in enumerate(prompts)), return_exceptions=True
    )
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        for result in results:
            if isinstance(result, Started):
                await result.aclose()
        raise failures[0]
    return results  # type: ignore[return-value]


async def merge(streams: list[Started]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they arrive, tagged with the request's position in `streams`."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: Started) -> None:
        try:
            async for output in stream:
                await queue.put((i, output))
        except Exception as exc:  # handed to the consumer, which re-raises it
            await queue.put((i, exc))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


@dataclass(kw_only=True)
class Collected:
    """A whole request's result: its choices by index and its usage."""

    choices: dict[int, CompletionOutput] = field(default_factory=dict)
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0

    def add(self, output: RequestOutput) -> None:
        if not self.prompt_token_ids:
            self.prompt_token_ids = list(output.prompt_token_ids)
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        self.num_prompt_tokens = output.num_prompt_tokens or len(output.prompt_token_ids)
        self.num_generated_tokens = output.num_generated_tokens
        self.num_cached_tokens = output.num_cached_tokens
        for delta in output.outputs:
            self.choices.setdefault(delta.index, CompletionOutput(index=delta.index)).add(delta)


async def collect(stream: Started) -> Collected:
    """Run a started request to the end."""
    result = Collected()
    try:
        async for output in stream:
            result.add(output)
    finally:
        await stream.aclose()
    return result
