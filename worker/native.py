"""Native jobs (RunPod's vLLM worker format): `prompt` or `messages`, vLLM `sampling_params`, token batches.

Output: `{"choices": [{"tokens": [...]}, ...], "usage": {"input": n, "output": m}}`; streamed, each
yield carries the text pieces since the previous one, grouped by the batch-size settings; not
streamed, one yield whose tokens list holds each choice's whole text.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from worker.openai.chat_template import render_chat
from worker.openai.errors import BadRequest
from worker.openai.generation import start
from worker.openai.params import native_sampling_params
from worker.openai.protocol import ChatMessage
from worker.openai.streaming import BatchSize
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

    @model_validator(mode="after")
    def _needs_input(self) -> NativeJob:
        if self.prompt is None and not self.messages:
            raise BadRequest("a native job needs `prompt` or `messages` (or `openai_route` for the OpenAI API)",
                             param="prompt")
        if self.apply_chat_template and self.messages is None and not isinstance(self.prompt, str):
            raise BadRequest("apply_chat_template needs a text prompt, not token ids", param="prompt")
        return self


def _prompt_ids(job: NativeJob, runtime: Runtime) -> list[int]:
    tokenizer = runtime.tokenizer
    if job.messages is not None or job.apply_chat_template:
        messages = job.messages if job.messages is not None else [{"role": "user", "content": job.prompt}]
        return render_chat(tokenizer, messages, chat_template=runtime.settings.custom_chat_template).token_ids
    if isinstance(job.prompt, list):
        return list(job.prompt)
    return tokenizer.encode(job.prompt, add_special_tokens=True)


async def run_native(raw: dict[str, Any], runtime: Runtime) -> AsyncIterator[dict[str, Any]]:
    """Yield the job's outputs; every check runs, and the engine request starts, before the first yield."""
    job = NativeJob.model_validate(raw)
    params = native_sampling_params(job.sampling_params, runtime.max_model_len)
    prompt_ids = await asyncio.to_thread(_prompt_ids, job, runtime)  # off the event loop, as OpenAI routes
    request_id = f"native-{job.request_id or uuid.uuid4().hex}-{uuid.uuid4().hex[:8]}"
    started = await start(runtime.engine, prompt_ids, params, request_id)
    settings = runtime.settings
    sizes = BatchSize(job.max_batch_size or settings.default_batch_size,
                      job.min_batch_size or settings.default_min_batch_size,
                      job.batch_size_growth_factor or settings.default_batch_size_growth_factor)
    texts = [[] for _ in range(params.n)]
    pending = 0
    last = started.first
    try:
        async for output in started:
            last = output
            for delta in output.outputs:
                if delta.index < params.n and (delta.text or not job.stream):
                    texts[delta.index].append(delta.text)
                    pending += 1
            if job.stream and pending >= sizes.size:
                yield _batch(texts, last)
                texts, pending = [[] for _ in range(params.n)], 0
                sizes.grow()
    finally:
        await started.aclose()
    if not job.stream:
        yield _batch([["".join(t)] for t in texts], last)
    elif pending:
        yield _batch(texts, last)


def _batch(texts: list[list[str]], output: Any) -> dict[str, Any]:
    prompt_tokens = output.num_prompt_tokens or len(output.prompt_token_ids)
    return {"choices": [{"tokens": t} for t in texts],
            "usage": {"input": prompt_tokens, "output": output.num_generated_tokens}}
