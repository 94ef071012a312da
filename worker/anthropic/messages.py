"""POST /v1/messages and /v1/messages/count_tokens: a Messages request runs as a chat generation.

The conversation, tools and settings become a chat request (worker/anthropic/conversation.py); the chat layer
validates, renders and samples as for /v1/chat/completions (forced tool calls and structured outputs held by
their grammars); the answer, read for reasoning and tool calls as the chat route reads it, comes back as a
`message` with content blocks (worker/anthropic/blocks.py), whole or as Anthropic's stream of events.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from engine.outputs import RequestOutput
from engine.sample.structured.spec import StructuredSpec
from worker.anthropic.blocks import ContentBlocks
from worker.anthropic.caching import Caching, delta_usage, message_usage, requested_caching
from worker.anthropic.conversation import chat_messages, chat_tool_choice, chat_tools
from worker.anthropic.errors import anthropic_error
from worker.anthropic.request import CountTokensRequest, MessagesRequest
from worker.openai.chat import ChatCall, chat_call, count_reasoning_tokens
from worker.openai.errors import BadRequest
from worker.openai.generation import Collected, engine_request_id
from worker.openai.protocol import ChatCompletionRequest
from worker.openai.runtime import Runtime
from worker.openai.stream_driver import run_to_end, stream_events
from worker.openai.tools.events import ContentDelta, Event

# Anthropic's default temperature (chat completions' default here is RunPod's 0.7).
DEFAULT_TEMPERATURE = 1.0


@dataclass
class MessageCall:
    """A validated Messages request, ready to run."""

    request: MessagesRequest
    chat: ChatCall
    id: str
    caching: Caching | None  # what the request's cache_control asked for (worker/anthropic/caching.py)

    @property
    def stream(self) -> bool:
        return self.request.stream


def prepare_message(body: Any, runtime: Runtime) -> MessageCall:
    """Everything that can fail before the engine runs: parsing, the conversation, the template."""
    request = MessagesRequest.model_validate(_object(body))
    caching = requested_caching(body)
    chat = _chat_call(request, runtime)
    return MessageCall(request, chat, f"msg_{request.extras.get('request_id') or uuid.uuid4().hex[:24]}", caching)


async def count_message_tokens(body: Any, runtime: Runtime) -> dict[str, Any]:
    """`{"input_tokens": n}`: the prompt the request would run, rendered and counted, nothing generated. Its images
    are read, so that each counts the tokens the engine widens its placeholder to (Qwen-VL, Gemma 4)."""
    call = await asyncio.to_thread(_count_call, body, runtime)
    if not call.prompt.images:
        return {"input_tokens": len(call.prompt.token_ids)}
    return {"input_tokens": await runtime.engine.prompt_length(call.prompt.token_ids, await call.image_files())}


def _count_call(body: Any, runtime: Runtime) -> ChatCall:
    request = CountTokensRequest.model_validate(_object(body))
    requested_caching(body)  # a malformed cache_control is refused here as on /v1/messages
    return _chat_call(request, runtime)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def _chat_call(request: CountTokensRequest, runtime: Runtime) -> ChatCall:
    messages = chat_messages(request.system, request.messages)
    tools = chat_tools(request.tools)
    # A final assistant turn is a prefill: the answer continues it.
    prefill = messages[-1]["role"] == "assistant"
    fields: dict[str, Any] = {
        **request.extras,
        "model": request.model,
        "messages": messages,
        "tools": tools,
        "tool_choice": chat_tool_choice(request.tool_choice, tools),
        "add_generation_prompt": not prefill,
        "continue_final_message": prefill,
    }
    if request.tool_choice is not None and request.tool_choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    kwargs = dict(fields.get("chat_template_kwargs") or {})
    thinking = request.thinking.type if request.thinking is not None else None
    if thinking in ("enabled", "disabled"):  # unset or "adaptive": the template's own default
        kwargs.setdefault("enable_thinking", thinking == "enabled")
    if request.output_config is not None and request.output_config.effort is not None:
        kwargs.setdefault("reasoning_effort", request.output_config.effort)
    if kwargs:
        fields["chat_template_kwargs"] = kwargs
    if isinstance(request, MessagesRequest):
        fields.update(
            max_tokens=request.max_tokens,
            stop=request.stop_sequences,
            top_p=request.top_p,
            top_k=request.top_k,
            temperature=DEFAULT_TEMPERATURE if request.temperature is None else request.temperature,
        )
    call = chat_call(ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None}), runtime)
    if thinking == "enabled" and call.output.reasoning is None:
        raise BadRequest(
            "thinking: this model does not think (its chat template has no <think> reasoning format, "
            "and REASONING_PARSER is not set); leave thinking unset or disabled",
            param="thinking",
        )
    schema = request.output_schema
    if schema is not None:
        if call.params.structured is not None:
            raise BadRequest(
                f"{schema[1]}: only one constraint on the output is allowed, and the request also sets "
                f"{call.params.structured.param}",
                param=schema[1],
            )
        call.params = dataclasses.replace(call.params, structured=StructuredSpec.json_schema(*schema))
    return call


class _Answer:
    """One answer read into content blocks as it arrives (or whole); streamed, the stream driver's event builder."""

    def __init__(self, call: MessageCall) -> None:
        self.call = call
        self.blocks = ContentBlocks()
        self.reader = None if call.chat.output.plain else call.chat.output.stream()
        self.result = Collected()

    def opening(self, first: RequestOutput) -> list[dict[str, Any]]:
        """`message_start` (the message with no content yet, its usage the prompt's) and a ping."""
        opening = self._usage(len(self.call.chat.prompt.token_ids), first.num_cached_tokens, 0, None)
        return [
            {"type": "message_start", "message": message_object(self.call, [], None, None, opening)},
            {"type": "ping"},
        ]

    def _usage(self, prompt: int, cached: int, output: int, thinking: int | None) -> dict[str, Any]:
        page_size = self.call.chat.runtime.settings.block_size
        return message_usage(self.call.caching, prompt, cached, output, thinking, page_size)

    def add(self, output: RequestOutput) -> list[dict[str, Any]]:
        self.result.add(output)
        events: list[dict[str, Any]] = []
        for delta in output.outputs:
            read: list[Event] = self.reader.push(delta.text) if self.reader is not None else [ContentDelta(delta.text)]
            events += self.blocks.push(read)
        return events

    def finish(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The closing stream events (the last block's stop) and the whole message."""
        events = self.blocks.push(self.reader.finish()) if self.reader is not None else []
        events += self.blocks.finish()
        choice = self.result.choices[0]
        stop_reason, stop_sequence = "end_turn", None
        if choice.finish_reason == "length":
            stop_reason = "max_tokens"
        elif self.blocks.called:
            stop_reason = "tool_use"
        elif isinstance(choice.stop_reason, str) and choice.stop_reason in (self.call.request.stop_sequences or []):
            stop_reason, stop_sequence = "stop_sequence", choice.stop_reason
        thinking = None
        if self.call.chat.output.reasoning:
            end = self.reader.reasoning_end if self.reader is not None else None
            thinking = count_reasoning_tokens(self.call.chat, choice.token_ids, end)
        used = self._usage(
            self.result.num_prompt_tokens, self.result.num_cached_tokens, self.result.num_generated_tokens, thinking
        )
        message = message_object(self.call, self.blocks.blocks, stop_reason, stop_sequence, used)
        return events, message

    def closing(self) -> list[dict[str, Any]]:
        """The last block's stop, `message_delta` (the stop reason and usage) and `message_stop`."""
        events, message = self.finish()
        delta = {
            "stop_reason": message["stop_reason"],
            "stop_sequence": message["stop_sequence"],
            "stop_details": None,
            "container": None,
        }
        return [
            *events,
            {"type": "message_delta", "delta": delta, "usage": delta_usage(message["usage"])},
            {"type": "message_stop"},
        ]

    def failed(self, exc: Exception) -> list[dict[str, Any]]:
        return [anthropic_error(exc)]


def message_object(
    call: MessageCall,
    content: list[dict[str, Any]],
    stop_reason: str | None,
    stop_sequence: str | None,
    used: dict[str, Any],
) -> dict[str, Any]:
    # `stop_details` (a refusal's category) and `container` (code execution's) are null: neither happens here.
    return {
        "id": call.id,
        "type": "message",
        "role": "assistant",
        "model": call.chat.model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "stop_details": None,
        "container": None,
        "usage": used,
    }


async def complete_message(call: MessageCall) -> dict[str, Any]:
    """The whole `message` object."""
    chat = call.chat
    answer = _Answer(call)
    await run_to_end(
        chat.runtime.engine,
        chat.prompt.token_ids,
        chat.params,
        engine_request_id(call.id),
        answer.add,
        chat.image_files,
    )
    return answer.finish()[1]


def stream_message(call: MessageCall) -> AsyncGenerator[dict[str, Any], None]:
    """Anthropic's event stream: message_start and a ping, each content block started, filled and stopped,
    message_delta (the stop reason and usage), message_stop; a failure after the first event is an `error`
    event. The engine request starts before the first event, so a bad request raises instead of streaming."""
    chat = call.chat
    return stream_events(
        chat.runtime.engine,
        chat.prompt.token_ids,
        chat.params,
        engine_request_id(call.id),
        _Answer(call),
        chat.image_files,
    )
