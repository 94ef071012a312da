"""POST /v1/chat/completions: validate, render the chat template, generate, answer whole or as chunks."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine.outputs import CompletionDelta, RequestOutput
from engine.sampling import SamplingParams
from worker.openai.chat_template import ChatPrompt, render_chat
from worker.openai.errors import BadRequest
from worker.openai.generation import Collected, collect, engine_request_id, response_id, start
from worker.openai.logprobs import chat_logprobs, prompt_logprobs
from worker.openai.models import check_model
from worker.openai.params import openai_sampling_params
from worker.openai.protocol import ChatCompletionRequest
from worker.openai.usage import usage
from worker.runtime import Runtime


@dataclass
class ChatCall:
    """A validated chat request, ready to run."""

    runtime: Runtime
    request: ChatCompletionRequest
    prompt: ChatPrompt
    params: SamplingParams
    id: str
    created: int
    model: str
    role: str
    echo: str  # the final message's text when `echo` asks for it, else ""

    @property
    def stream(self) -> bool:
        return bool(self.request.stream)


def prepare_chat(body: Any, runtime: Runtime) -> ChatCall:
    """Everything that can fail before the engine runs: parsing, model name, parameters, template."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return chat_call(ChatCompletionRequest.model_validate(body), runtime)


def chat_call(request: ChatCompletionRequest, runtime: Runtime) -> ChatCall:
    """A parsed request made ready to run: model name, sampling parameters, the rendered template."""
    model = check_model(runtime, request.model)
    params = openai_sampling_params(request, runtime.max_model_len)
    prompt = render_chat(
        runtime.tokenizer,
        request.messages,
        chat_template=request.chat_template or runtime.settings.custom_chat_template,
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        add_special_tokens=request.add_special_tokens,
        documents=request.documents,
        tools=request.tools,
        template_kwargs=request.chat_template_kwargs,
    )
    last = prompt.messages[-1]
    role = runtime.settings.response_role
    echo = last["content"] if request.echo and last["role"] == role else ""
    return ChatCall(runtime, request, prompt, params, response_id("chatcmpl", request.request_id),
                    int(time.time()), model, role, echo)


async def complete_chat(call: ChatCall) -> dict[str, Any]:
    """The whole `chat.completion` object."""
    started = await start(call.runtime.engine, call.prompt.token_ids, call.params, engine_request_id(call.id))
    result = await collect(started)
    return chat_response(call, result)


def chat_response(call: ChatCall, result: Collected) -> dict[str, Any]:
    request = call.request
    choices = []
    for index in sorted(result.choices):
        choice = result.choices[index]
        item: dict[str, Any] = {
            "index": index,
            "message": {"role": call.role, "content": call.echo + choice.text, "refusal": None, "annotations": []},
            "logprobs": chat_logprobs(choice.logprobs or [], request.top_logprobs or 0) if request.logprobs else None,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }
        if request.return_token_ids:
            item["token_ids"] = choice.token_ids
        choices.append(item)
    response: dict[str, Any] = {
        "id": call.id,
        "object": "chat.completion",
        "created": call.created,
        "model": call.model,
        "choices": choices,
        "usage": usage(result.num_prompt_tokens, result.num_generated_tokens, result.num_cached_tokens),
    }
    if request.return_token_ids:
        response["prompt_token_ids"] = result.prompt_token_ids
    if request.prompt_logprobs is not None:
        response["prompt_logprobs"] = prompt_logprobs(result.prompt_logprobs)
    return response


async def stream_chat(call: ChatCall) -> AsyncIterator[dict[str, Any]]:
    """`chat.completion.chunk` objects as OpenAI streams them: roles, deltas, one finish per choice, usage.

    The engine request starts before the first chunk, so a bad request raises from the first
    `__anext__` instead of streaming.
    """
    started = await start(call.runtime.engine, call.prompt.token_ids, call.params, engine_request_id(call.id))
    request = call.request
    options = request.stream_options
    include_usage = bool(options and options.include_usage)
    continuous = include_usage and bool(options and options.continuous_usage_stats)
    last: RequestOutput = started.first

    def chunk(choice: dict[str, Any], opening: bool = False, **extra: Any) -> dict[str, Any]:
        out = {"id": call.id, "object": "chat.completion.chunk", "created": call.created, "model": call.model,
               "choices": [choice], **extra}
        if include_usage:
            # An opening (role) chunk comes before any token, as in vLLM: no completion tokens yet.
            out["usage"] = _usage(last, 0 if opening else None) if continuous else None
        return out

    try:
        first_extra: dict[str, Any] = {}
        if request.return_token_ids:
            first_extra["prompt_token_ids"] = list(started.first.prompt_token_ids)
        if request.prompt_logprobs is not None:
            first_extra["prompt_logprobs"] = prompt_logprobs(started.first.prompt_logprobs)
        for index in range(request.n):
            delta = {"role": call.role, "content": call.echo}
            yield chunk({"index": index, "delta": delta, "logprobs": None, "finish_reason": None}, opening=True,
                        **(first_extra if index == 0 else {}))
        async for output in started:
            last = output
            for delta in output.outputs:
                for choice in _delta_choices(call, delta):
                    yield chunk(choice)
        if include_usage:
            yield {"id": call.id, "object": "chat.completion.chunk", "created": call.created, "model": call.model,
                   "choices": [], "usage": _usage(last)}
    finally:
        await started.aclose()


def _delta_choices(call: ChatCall, delta: CompletionDelta) -> list[dict[str, Any]]:
    """A delta's content chunk (when it carries text or tokens a client asked to see) and its finish chunk."""
    request = call.request
    out = []
    shows_tokens = bool(delta.token_ids) and (request.logprobs or request.return_token_ids)
    if delta.text or shows_tokens:
        choice: dict[str, Any] = {
            "index": delta.index,
            "delta": {"content": delta.text},
            "logprobs": chat_logprobs(delta.logprobs or [], request.top_logprobs or 0) if request.logprobs else None,
            "finish_reason": None,
        }
        if request.return_token_ids:
            choice["token_ids"] = list(delta.token_ids)
        out.append(choice)
    if delta.finish_reason is not None:
        out.append({"index": delta.index, "delta": {}, "logprobs": None, "finish_reason": delta.finish_reason,
                    "stop_reason": delta.stop_reason})
    return out


def _usage(output: RequestOutput, generated: int | None = None) -> dict[str, Any]:
    """Usage as of `output`; `generated` overrides its completion-token count."""
    prompt_tokens = output.num_prompt_tokens or len(output.prompt_token_ids)
    completion = output.num_generated_tokens if generated is None else generated
    return usage(prompt_tokens, completion, output.num_cached_tokens)
