"""POST /v1/completions: prompts as text, token ids or lists of either; whole answers or streamed chunks.

Each prompt is its own engine request; choice i of prompt p is index p * n + i, as in OpenAI's API.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from engine.outputs import CompletionDelta, CompletionOutput, PositionLogprobs, RequestOutput
from engine.sample.params import SamplingParams
from engine.text.detokenizer import token_bytes, token_text
from worker.openai.errors import BadRequest
from worker.openai.generation import Collected, collect, engine_request_id, merge, response_id, start_all
from worker.openai.logprobs import TextOffsets, completion_logprobs, prompt_logprobs
from worker.openai.models import resolve_model
from worker.openai.params import openai_sampling_params
from worker.openai.protocol import CompletionRequest
from worker.openai.runtime import Runtime
from worker.openai.usage import usage


@dataclass(kw_only=True)
class CompletionCall:
    """A validated completions request: its prompts tokenized, ready to run."""

    runtime: Runtime
    request: CompletionRequest
    prompts: list[list[int]]
    params: SamplingParams
    id: str
    created: int
    model: str

    @property
    def stream(self) -> bool:
        return bool(self.request.stream)


def prepare_completion(body: Any, runtime: Runtime) -> CompletionCall:
    """Parse, check the model and parameters, and tokenize every prompt."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    request = CompletionRequest.model_validate(body)
    model, adapter = resolve_model(runtime, request.model)
    params = openai_sampling_params(request, runtime.max_model_len, adapter)
    prompts = _tokenize(runtime.tokenizer, request.prompt, request.add_special_tokens)
    return CompletionCall(
        runtime=runtime,
        request=request,
        prompts=prompts,
        params=params,
        id=response_id("cmpl", request.request_id),
        created=int(time.time()),
        model=model,
    )


def _tokenize(tokenizer: Any, prompt: Any, add_special_tokens: bool) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt, add_special_tokens=add_special_tokens)]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [
        list(p) if isinstance(p, list) else tokenizer.encode(p, add_special_tokens=add_special_tokens) for p in prompt
    ]


async def complete(call: CompletionCall) -> dict[str, Any]:
    """The whole `text_completion` object."""
    started = await start_all(call.runtime.engine, call.prompts, call.params, engine_request_id(call.id))
    tasks = [asyncio.ensure_future(collect(s)) for s in started]
    try:
        results = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:  # one prompt failed or the caller went away: stop the others too
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    request = call.request
    if request.scores_only:
        results = [_without_generation(r) for r in results]
    choices = []
    for p, result in enumerate(results):
        echo = _Echo(call, result.prompt_token_ids, result.prompt_logprobs) if request.echo else None
        for index in sorted(result.choices):
            choice = result.choices[index]
            text = (echo.text if echo else "") + choice.text
            logprobs = None
            if request.logprobs is not None:
                generated = list(choice.logprobs or [])
                logprobs = (
                    echo.logprobs(generated, request.logprobs, TextOffsets())
                    if echo
                    else completion_logprobs(generated, request.logprobs, TextOffsets())
                )
            item = {
                "index": p * request.n + index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason,
            }
            _extras(call, item, result, choice.token_ids)
            choices.append(item)
    return {
        "id": call.id,
        "object": "text_completion",
        "created": call.created,
        "model": call.model,
        "choices": choices,
        "usage": _total_usage(results),
    }


def _extras(call: CompletionCall, item: dict[str, Any], result: Collected, token_ids: list[int]) -> None:
    """vLLM's optional fields: prompt_token_ids / token_ids and prompt_logprobs."""
    if call.request.return_token_ids:
        item["prompt_token_ids"] = list(result.prompt_token_ids)
        item["token_ids"] = list(token_ids)
    if call.request.prompt_logprobs is not None:
        item["prompt_logprobs"] = prompt_logprobs(result.prompt_logprobs)


def _without_generation(result: Collected) -> Collected:
    """A scoring request's result as returned (echo, max_tokens 0): the one token the engine ran is left out."""
    return dataclasses.replace(
        result,
        choices={i: CompletionOutput(index=i, finish_reason="length") for i in result.choices},
        num_generated_tokens=0,
    )


def _total_usage(results: list[Collected]) -> dict[str, Any]:
    return usage(
        sum(r.num_prompt_tokens for r in results),
        sum(r.num_generated_tokens for r in results),
        sum(r.num_cached_tokens for r in results),
    )


class _Echo:
    """The prompt as `echo` returns it: its text, and per token its text and logprobs (the first has none)."""

    def __init__(self, call: CompletionCall, prompt_ids: list[int], positions: list[PositionLogprobs | None] | None):
        tokenizer = call.runtime.tokenizer
        self.text = tokenizer.decode(prompt_ids, skip_special_tokens=False)
        self.positions: list[PositionLogprobs | None] = list(positions or [None] * len(prompt_ids))
        self.pieces = [(token_text(tokenizer, tid), token_bytes(tokenizer, tid)) for tid in prompt_ids]

    def logprobs(self, generated: list[PositionLogprobs], top: int, offsets: TextOffsets) -> dict[str, Any]:
        """Completion logprobs of the echoed prompt followed by the generated tokens; `offsets` moves past both."""
        pieces = self.pieces + [(position.chosen.token, position.chosen.token_bytes) for position in generated]
        return completion_logprobs(self.positions + list(generated), top, offsets, pieces)


async def stream_completion(call: CompletionCall) -> AsyncGenerator[dict[str, Any], None]:
    """`text_completion` chunks: text deltas per choice, a finish chunk per choice, then usage if asked.

    Every prompt's request starts before the first chunk, so a bad request raises from the first
    `__anext__` instead of streaming.
    """
    started = await start_all(call.runtime.engine, call.prompts, call.params, engine_request_id(call.id))
    state = _StreamState(call)
    try:
        async for p, output in merge(started):
            for chunk in state.chunks(p, output):
                yield chunk
    finally:
        for stream in started:
            await stream.aclose()
    if state.include_usage:
        yield state.usage_chunk()


class _StreamState:
    """What a completions stream remembers between engine outputs: per-choice text offsets, per-prompt usage."""

    def __init__(self, call: CompletionCall) -> None:
        self.call = call
        options = call.request.stream_options
        self.include_usage = bool(options and options.include_usage)
        self.continuous = self.include_usage and bool(options and options.continuous_usage_stats)
        self.offsets: dict[int, TextOffsets] = {}  # choice index -> where its next token's text starts
        self.first: dict[int, RequestOutput] = {}  # prompt -> its first output (prompt ids and logprobs)
        self.latest: dict[int, RequestOutput] = {}  # prompt -> its latest output (running usage)

    def chunk(self, choice: dict[str, Any] | None, usage_: dict[str, Any] | None = None) -> dict[str, Any]:
        call = self.call
        out = {
            "id": call.id,
            "object": "text_completion",
            "created": call.created,
            "model": call.model,
            "choices": [choice] if choice is not None else [],
        }
        if self.include_usage:
            out["usage"] = usage_
        return out

    def usage_chunk(self) -> dict[str, Any]:
        return self.chunk(None, _total_usage([self._collected(o) for o in self.latest.values()]))

    def _collected(self, output: RequestOutput) -> Collected:
        collected = _as_collected(output)
        return _without_generation(collected) if self.call.request.scores_only else collected

    def chunks(self, p: int, output: RequestOutput) -> list[dict[str, Any]]:
        request = self.call.request
        self.first.setdefault(p, output)
        self.latest[p] = output
        # continuous_usage_stats: every chunk carries its prompt's usage so far (vLLM's extra).
        running = _total_usage([self._collected(output)]) if self.continuous else None
        out = []
        for delta in output.outputs:
            if request.scores_only:  # only the echoed prompt goes out, then the choice ends
                delta = CompletionDelta(
                    index=delta.index,
                    text="",
                    token_ids=[],
                    logprobs=None,
                    finish_reason=delta.finish_reason and "length",
                )
            index = p * request.n + delta.index
            if index not in self.offsets:
                self.offsets[index] = TextOffsets()
                if request.echo or request.return_token_ids or request.prompt_logprobs is not None:
                    out.append(self.chunk(self._opening(index, self.first[p]), running))
            logprobs = None
            if request.logprobs is not None and delta.logprobs:
                logprobs = completion_logprobs(list(delta.logprobs), request.logprobs, self.offsets[index])
            if delta.text or logprobs is not None or (request.return_token_ids and delta.token_ids):
                item = {"index": index, "text": delta.text, "logprobs": logprobs, "finish_reason": None}
                if request.return_token_ids:
                    item["token_ids"] = list(delta.token_ids)
                out.append(self.chunk(item, running))
            if delta.finish_reason is not None:
                out.append(
                    self.chunk(
                        {
                            "index": index,
                            "text": "",
                            "logprobs": None,
                            "finish_reason": delta.finish_reason,
                            "stop_reason": delta.stop_reason,
                        },
                        running,
                    )
                )
        return out

    def _opening(self, index: int, first: RequestOutput) -> dict[str, Any]:
        """A choice's opening chunk: the echoed prompt (with its logprobs) and the prompt-level extras."""
        request = self.call.request
        item: dict[str, Any] = {"index": index, "text": "", "logprobs": None, "finish_reason": None}
        if request.echo:
            echo = _Echo(self.call, list(first.prompt_token_ids), first.prompt_logprobs)
            item["text"] = echo.text
            if request.logprobs is not None:
                # The choice's offsets go on from the prompt's, exactly as in the whole answer.
                item["logprobs"] = echo.logprobs([], request.logprobs, self.offsets[index])
        if request.return_token_ids:
            item["prompt_token_ids"] = list(first.prompt_token_ids)
            item["token_ids"] = []
        if request.prompt_logprobs is not None:
            item["prompt_logprobs"] = prompt_logprobs(first.prompt_logprobs)
        return item


def _as_collected(output: RequestOutput) -> Collected:
    return Collected(
        num_prompt_tokens=output.num_prompt_tokens or len(output.prompt_token_ids),
        num_generated_tokens=output.num_generated_tokens,
        num_cached_tokens=output.num_cached_tokens,
    )
