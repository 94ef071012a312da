"""POST /v1/chat/completions: validate, render the chat template, generate, answer whole or as chunks."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from engine.outputs import CompletionDelta, CompletionOutput, RequestOutput
from engine.sample.params import SamplingParams
from worker.openai.chat_deltas import delta_dicts
from worker.openai.chat_output import OutputFormat
from worker.openai.chat_template import ChatPrompt
from worker.openai.chat_tools import render_with_tools, tool_params
from worker.openai.errors import BadRequest
from worker.openai.generation import Collected, collect, engine_request_id, response_id, start
from worker.openai.harmony.chat import HarmonyFormat, harmony_request
from worker.openai.images import read_images, take_images
from worker.openai.logprobs import chat_logprobs, prompt_logprobs
from worker.openai.models import resolve_model
from worker.openai.params import openai_sampling_params
from worker.openai.protocol import ChatCompletionRequest
from worker.openai.runtime import Runtime
from worker.openai.stream_driver import stream_events
from worker.openai.tools.plan import ToolPlan
from worker.openai.usage import usage


@dataclass(kw_only=True)
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
    tools: ToolPlan | None = None
    output: OutputFormat | HarmonyFormat = field(default_factory=OutputFormat)  # how answers are read

    @property
    def stream(self) -> bool:
        return bool(self.request.stream)

    async def image_files(self) -> list[Any]:
        """The prompt's images as engine.inputs.ImageData (data: URLs decoded, http(s) ones fetched)."""
        return await read_images(self.prompt.images, self.runtime.settings)


def prepare_chat(body: Any, runtime: Runtime) -> ChatCall:
    """Everything that can fail before the engine runs: parsing, model name, parameters, template."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return chat_call(ChatCompletionRequest.model_validate(body), runtime)


def chat_call(request: ChatCompletionRequest, runtime: Runtime) -> ChatCall:
    """A parsed request made ready to run: model name, sampling parameters, the rendered template."""
    model, adapter = resolve_model(runtime, request.model)
    params = openai_sampling_params(request, runtime.max_model_len, adapter)
    image_prompt = getattr(runtime.engine, "image_prompt", None)
    messages, images = take_images(request.messages, image_prompt is not None, runtime.settings)
    output: OutputFormat | HarmonyFormat
    if runtime.tool_format == "harmony":  # gpt-oss: openai-harmony renders and reads, not a chat template
        prompt, plan, output, params = harmony_request(runtime.harmony, request, params)
    else:
        prompt, plan, output, constraint = render_with_tools(
            runtime,
            messages,
            tools=request.tools,
            tool_choice=request.tool_choice,
            parallel=request.parallel_tool_calls is not False,
            separate_reasoning=request.separate_reasoning,
            chat_template=request.chat_template,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            add_special_tokens=request.add_special_tokens,
            documents=request.documents,
            template_kwargs=request.chat_template_kwargs,
            images=len(images),
            image_prompt=image_prompt,
        )
        prompt.images = images
        params = tool_params(params, plan, runtime, constraint, output, prompt.text)
    last = prompt.messages[-1]
    role = runtime.settings.response_role
    echo = last["content"] if request.echo and last["role"] == role else ""
    return ChatCall(
        runtime=runtime,
        request=request,
        prompt=prompt,
        params=params,
        id=response_id("chatcmpl", request.request_id),
        created=int(time.time()),
        model=model,
        role=role,
        echo=echo,
        tools=plan,
        output=output,
    )


async def complete_chat(call: ChatCall) -> dict[str, Any]:
    """The whole `chat.completion` object."""
    started = await start(
        call.runtime.engine, call.prompt.token_ids, call.params, engine_request_id(call.id), await call.image_files()
    )
    result = await collect(started)
    return chat_response(call, result)


def chat_response(call: ChatCall, result: Collected) -> dict[str, Any]:
    request = call.request
    choices = []
    thinking = 0
    for index in sorted(result.choices):
        choice = result.choices[index]
        message, calls, tokens = _message(call, choice)
        thinking += tokens
        item: dict[str, Any] = {
            "index": index,
            "message": message,
            "logprobs": chat_logprobs(choice.logprobs or [], request.top_logprobs or 0) if request.logprobs else None,
            "finish_reason": _finish_reason(choice.finish_reason, calls),
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
        "usage": usage(
            result.num_prompt_tokens,
            result.num_generated_tokens,
            result.num_cached_tokens,
            thinking if call.output.reasoning else None,
        ),
    }
    if request.return_token_ids:
        response["prompt_token_ids"] = result.prompt_token_ids
    if request.prompt_logprobs is not None:
        response["prompt_logprobs"] = prompt_logprobs(result.prompt_logprobs)
    return response


def _message(call: ChatCall, choice: CompletionOutput) -> tuple[dict[str, Any], bool, int]:
    """A choice's `message`, whether it calls tools, and how many of its tokens were reasoning."""
    if call.output.plain:
        return {"role": call.role, "content": call.echo + choice.text, "refusal": None, "annotations": []}, False, 0
    parsed, end = call.output.read(choice.text, choice.token_ids)
    content = call.echo + (parsed.content or "") if call.echo else parsed.content
    message: dict[str, Any] = {"role": call.role, "content": content, "refusal": None, "annotations": []}
    if parsed.tool_calls:
        message["tool_calls"] = [c.to_openai() for c in parsed.tool_calls]
    if call.output.reasoning:
        # SGLang and LangChain read `reasoning_content`; current vLLM sends `reasoning`.
        message["reasoning_content"] = message["reasoning"] = parsed.reasoning
    tokens = count_reasoning_tokens(call, choice.token_ids, end)
    return message, bool(parsed.tool_calls), tokens


def count_reasoning_tokens(call: ChatCall, token_ids: list[int], end: int | None) -> int:
    """How many of an answer's tokens were reasoning (`end`: where the reasoning ended in its text)."""
    if not call.output.reasoning:
        return 0
    return call.output.reasoning_tokens(call.runtime.tokenizer, token_ids, end, call.params.skip_special_tokens)


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """ "tool_calls" when an answer that ended by itself called tools (one cut short keeps "length")."""
    return "tool_calls" if called and reason == "stop" else reason


def stream_chat(call: ChatCall) -> AsyncGenerator[dict[str, Any], None]:
    """`chat.completion.chunk` objects as OpenAI streams them: roles, deltas, one finish per choice, usage.

    The engine request starts before the first chunk, so a bad request raises from the first
    `__anext__` instead of streaming; an error after that raises for the SSE framing to report.
    """
    return stream_events(
        call.runtime.engine,
        call.prompt.token_ids,
        call.params,
        engine_request_id(call.id),
        _ChatChunks(call),
        call.image_files,
    )


class _ChatChunks:
    """The chunks of one streamed chat completion, as the stream driver asks for them."""

    def __init__(self, call: ChatCall) -> None:
        self.call = call
        options = call.request.stream_options
        self.include_usage = bool(options and options.include_usage)
        self.continuous = self.include_usage and bool(options and options.continuous_usage_stats)
        self.readers: dict[int, _Reader] = {}
        self.last: RequestOutput | None = None  # the latest output: usage so far

    def _chunk(self, choice: dict[str, Any], opening: bool = False, **extra: Any) -> dict[str, Any]:
        call = self.call
        out = {
            "id": call.id,
            "object": "chat.completion.chunk",
            "created": call.created,
            "model": call.model,
            "choices": [choice],
            **extra,
        }
        if self.include_usage:
            # An opening (role) chunk comes before any token, as in vLLM: no completion tokens yet.
            out["usage"] = _usage(self._latest, 0 if opening else None) if self.continuous else None
        return out

    @property
    def _latest(self) -> RequestOutput:
        assert self.last is not None, "usage is read once the stream has opened"
        return self.last

    def opening(self, first: RequestOutput) -> list[dict[str, Any]]:
        call, request = self.call, self.call.request
        self.last = first
        first_extra: dict[str, Any] = {}
        if request.return_token_ids:
            first_extra["prompt_token_ids"] = list(first.prompt_token_ids)
        if request.prompt_logprobs is not None:
            first_extra["prompt_logprobs"] = prompt_logprobs(first.prompt_logprobs)
        chunks = []
        for index in range(request.n):
            delta = {"role": call.role, "content": call.echo}
            chunks.append(
                self._chunk(
                    {"index": index, "delta": delta, "logprobs": None, "finish_reason": None},
                    opening=True,
                    **(first_extra if index == 0 else {}),
                )
            )
        self.readers = {i: _Reader(call) for i in range(request.n)}
        return chunks

    def add(self, output: RequestOutput) -> list[dict[str, Any]]:
        self.last = output
        chunks = []
        for delta in output.outputs:
            reader = self.readers.setdefault(delta.index, _Reader(self.call))
            chunks += [self._chunk(choice) for choice in _delta_choices(self.call, delta, reader)]
        return chunks

    def closing(self) -> list[dict[str, Any]]:
        if not self.include_usage:
            return []
        call = self.call
        thinking = sum(r.reasoning_tokens() for r in self.readers.values()) if call.output.reasoning else None
        return [
            {
                "id": call.id,
                "object": "chat.completion.chunk",
                "created": call.created,
                "model": call.model,
                "choices": [],
                "usage": _usage(self._latest, reasoning=thinking),
            }
        ]

    def failed(self, exc: Exception) -> None:
        return None  # chat has no failure chunk: the SSE framing turns the error into an error event


class _Reader:
    """One streamed choice's parser and the token ids it has seen (for counting its reasoning tokens)."""

    def __init__(self, call: ChatCall) -> None:
        self.call = call
        self.stream = None if call.output.plain else call.output.stream()
        self.token_ids: list[int] = []

    def reasoning_tokens(self) -> int:
        end = self.stream.reasoning_end if self.stream is not None else None
        return count_reasoning_tokens(self.call, self.token_ids, end)


def _delta_choices(call: ChatCall, delta: CompletionDelta, reader: _Reader) -> list[dict[str, Any]]:
    """A delta's chunks (when it carries text or tokens a client asked to see) and its finish chunk."""
    request = call.request
    reader.token_ids += delta.token_ids
    out = []
    shows_tokens = bool(delta.token_ids) and (request.logprobs or request.return_token_ids)
    if reader.stream is None:
        deltas = [{"content": delta.text}] if delta.text else []
    else:
        events = reader.stream.push(delta.text, delta.token_ids)
        if delta.finish_reason is not None:
            events += reader.stream.finish()
        deltas = delta_dicts(events)
    if shows_tokens and not deltas:
        deltas = [{"content": ""}]  # the tokens' text is held back (it may be markup), their logprobs are not
    for i, body in enumerate(deltas):  # the delta's logprobs and token ids go with its first chunk
        choice: dict[str, Any] = {
            "index": delta.index,
            "delta": body,
            "logprobs": chat_logprobs(delta.logprobs or [], request.top_logprobs or 0)
            if request.logprobs and i == 0
            else None,
            "finish_reason": None,
        }
        if request.return_token_ids:
            choice["token_ids"] = list(delta.token_ids) if i == 0 else []
        out.append(choice)
    if delta.finish_reason is not None:
        called = reader.stream is not None and reader.stream.called
        out.append(
            {
                "index": delta.index,
                "delta": {},
                "logprobs": None,
                "finish_reason": _finish_reason(delta.finish_reason, called),
                "stop_reason": delta.stop_reason,
            }
        )
    return out


def _usage(output: RequestOutput, generated: int | None = None, reasoning: int | None = None) -> dict[str, Any]:
    """Usage as of `output`; `generated` overrides its completion-token count."""
    prompt_tokens = output.num_prompt_tokens or len(output.prompt_token_ids)
    completion = output.num_generated_tokens if generated is None else generated
    return usage(prompt_tokens, completion, output.num_cached_tokens, reasoning)
