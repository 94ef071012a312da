"""Native jobs (RunPod's vLLM worker format): `prompt` or `messages`, vLLM `sampling_params`, token batches.

Output: `{"choices": [{"tokens": [...]}, ...], "usage": {"input": n, "output": m}}`; streamed, each
yield carries the text pieces since the previous one, grouped by the batch-size settings; not
streamed, one yield whose tokens list holds each choice's whole text.

With `tools` (and `messages`), answers are read as on the chat route: `tokens` hold the content, and a
choice carries `tool_calls` (whole calls, or the chat stream's call deltas when streamed) and
`reasoning_content` (the reasoning, or its pieces) when it has them.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from engine.sample.params import SamplingParams
from worker.openai.chat_deltas import delta_dicts
from worker.openai.chat_output import OutputFormat, OutputStream
from worker.openai.chat_template import render_chat
from worker.openai.chat_tools import render_with_tools, tool_params
from worker.openai.errors import BadRequest
from worker.openai.generation import start
from worker.openai.images import ImageRef, read_images, take_images
from worker.openai.models import resolve_model
from worker.openai.params import native_sampling_params
from worker.openai.protocol import ChatMessage
from worker.openai.streaming import BatchSize
from worker.openai.tools.definitions import check_tool_choice, check_tools
from worker.openai.tools.events import Event
from worker.runtime import Runtime


class NativeJob(BaseModel):
    """A native job's input."""

    model_config = ConfigDict(extra="allow")

    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)  # checked as the OpenAI route checks them
    sampling_params: dict[str, Any] | None = None
    stream: StrictBool = False
    apply_chat_template: StrictBool = False
    max_batch_size: int | None = Field(None, ge=1)
    min_batch_size: int | None = Field(None, ge=1)
    batch_size_growth_factor: float | None = Field(None, ge=1.0)
    request_id: str | None = None
    model: str | None = None  # a LoRA adapter (or "<base>:<adapter>"), as on the OpenAI routes; None: the base model
    tools: list[Any] | None = None  # with messages: read answers for calls, as the chat route does
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None

    @model_validator(mode="after")
    def _needs_input(self) -> NativeJob:
        if self.prompt is None and not self.messages:
            raise BadRequest(
                "a native job needs `prompt` or `messages` (or `openai_route` for the OpenAI API)", param="prompt"
            )
        if self.tools is not None and self.messages is None:
            raise BadRequest("tools need `messages` (the chat template shows them to the model)", param="tools")
        check_tool_choice(self.tool_choice, check_tools(self.tools))
        if self.apply_chat_template and self.messages is None and not isinstance(self.prompt, str):
            raise BadRequest("apply_chat_template needs a text prompt, not token ids", param="prompt")
        return self


def _prompt(
    job: NativeJob, runtime: Runtime, params: SamplingParams
) -> tuple[list[int], OutputFormat | None, SamplingParams, list[ImageRef]]:
    """The prompt's token ids, how answers are read (None: as plain text), the parameters the tools need and the
    messages' images (the chat route's image_url parts)."""
    image_prompt = getattr(runtime.engine, "image_prompt", None)
    messages, images = (
        (job.messages, [])
        if job.messages is None
        else take_images(job.messages, image_prompt is not None, runtime.settings)
    )
    shown: dict[str, Any] = {"images": len(images), "image_prompt": image_prompt}
    if messages is None or job.tools is None:
        return _prompt_ids(job, runtime, messages, shown), None, params, images
    if runtime.tool_format == "harmony":
        # NOTE: harmony answers are read token by token (openai-harmony's parser); native jobs read text.
        raise BadRequest(
            "tools in a native job are not supported for this model's harmony format (gpt-oss): "
            "send the request to /v1/chat/completions or /v1/responses",
            param="tools",
        )
    prompt, plan, output, constraint = render_with_tools(
        runtime,
        messages,
        tools=job.tools,
        tool_choice=job.tool_choice,
        parallel=job.parallel_tool_calls is not False,
        **shown,
    )
    return prompt.token_ids, output, tool_params(params, plan, runtime, constraint, output, prompt.text), images


def _prompt_ids(job: NativeJob, runtime: Runtime, messages: list[Any] | None, shown: dict[str, Any]) -> list[int]:
    tokenizer = runtime.tokenizer
    if messages is not None or job.apply_chat_template:
        messages = messages if messages is not None else [{"role": "user", "content": job.prompt}]
        return render_chat(tokenizer, messages, chat_template=runtime.settings.custom_chat_template, **shown).token_ids
    if isinstance(job.prompt, list):
        return list(job.prompt)
    return tokenizer.encode(job.prompt, add_special_tokens=True)


async def run_native(raw: dict[str, Any], runtime: Runtime) -> AsyncGenerator[dict[str, Any], None]:
    """Yield the job's outputs; every check runs, and the engine request starts, before the first yield."""
    job = NativeJob.model_validate(raw)
    adapter = resolve_model(runtime, job.model)[1] if job.model is not None else None
    params = native_sampling_params(job.sampling_params, runtime.max_model_len, adapter)
    # Off the event loop, as on the OpenAI routes.
    prompt_ids, reading, params, images = await asyncio.to_thread(_prompt, job, runtime, params)
    files = await read_images(images, runtime.settings)
    request_id = f"native-{job.request_id or uuid.uuid4().hex}-{uuid.uuid4().hex[:8]}"
    started = await start(runtime.engine, prompt_ids, params, request_id, files)
    settings = runtime.settings
    sizes = BatchSize(
        job.max_batch_size or settings.default_batch_size,
        job.min_batch_size or settings.default_min_batch_size,
        job.batch_size_growth_factor or settings.default_batch_size_growth_factor,
    )
    readers = [reading.stream() if reading is not None and job.stream else None for _ in range(params.n)]
    batches = [_Choice() for _ in range(params.n)]
    pending = 0
    last = started.first
    try:
        async for output in started:
            last = output
            for delta in output.outputs:
                if delta.index < params.n and (delta.text or delta.finish_reason or not job.stream):
                    pending += batches[delta.index].add(delta.text, readers[delta.index], delta.finish_reason)
            if job.stream and pending >= sizes.size:
                yield _batch(batches, last)
                batches, pending = [_Choice() for _ in range(params.n)], 0
                sizes.grow()
    finally:
        await started.aclose()
    if not job.stream:
        yield _batch([_Choice.whole("".join(c.tokens), reading) for c in batches], last)
    elif pending:
        yield _batch(batches, last)


class _Choice:
    """One choice's part of a yield: text pieces (the content, when answers are read) and any call deltas and
    reasoning pieces."""

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.extra: dict[str, Any] = {}

    def add(self, text: str, reader: OutputStream | None, finish_reason: str | None) -> int:
        """Take a delta; return how many pieces it added."""
        if reader is None:
            if not text and finish_reason:
                return 0
            self.tokens.append(text)
            return 1
        events: list[Event] = reader.push(text) + (reader.finish() if finish_reason else [])
        before = len(self.tokens) + sum(len(v) for v in self.extra.values())
        for body in delta_dicts(events):
            if "content" in body:
                self.tokens.append(body["content"])
            elif "tool_calls" in body:
                self.extra.setdefault("tool_calls", []).extend(body["tool_calls"])
            else:
                self.extra.setdefault("reasoning_content", []).append(body["reasoning_content"])
        return len(self.tokens) + sum(len(v) for v in self.extra.values()) - before

    @classmethod
    def whole(cls, text: str, reading: OutputFormat | None) -> _Choice:
        choice = cls()
        if reading is None:
            choice.tokens = [text]
            return choice
        parsed = reading.parse(text)
        choice.tokens = [parsed.content or ""]
        choice.extra["tool_calls"] = [c.to_openai() for c in parsed.tool_calls]
        if reading.reasoning:
            choice.extra["reasoning_content"] = parsed.reasoning
        return choice

    def as_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, **self.extra}


def _batch(choices: list[_Choice], output: Any) -> dict[str, Any]:
    prompt_tokens = output.num_prompt_tokens or len(output.prompt_token_ids)
    return {
        "choices": [c.as_dict() for c in choices],
        "usage": {"input": prompt_tokens, "output": output.num_generated_tokens},
    }
