"""POST /v1/responses: a Responses API request runs as a chat generation and answers as response items.

The input items (with a stored response's conversation in front when `previous_response_id` names
one) become chat messages; the chat layer validates, renders and samples as for /v1/chat/completions;
the generated text comes back as one `message` output item, whole or as OpenAI's stream of events.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine.structured.spec import StructuredSpec
from worker.openai.chat import ChatCall, chat_call
from worker.openai.errors import BadRequest, ResponseNotFound, error_body, status_of
from worker.openai.generation import Collected, collect, engine_request_id, start
from worker.openai.logprobs import chat_logprobs
from worker.openai.models import check_model
from worker.openai.params import DEFAULT_TEMPERATURE
from worker.openai.protocol import ChatCompletionRequest
from worker.openai.response_items import chat_messages, chat_tool_choice, chat_tools, input_items, new_id
from worker.openai.response_request import RESPONSES_ONLY, ResponsesRequest
from worker.openai.response_store import StoredResponse
from worker.runtime import Runtime


@dataclass
class ResponseCall:
    """A validated Responses request, ready to run."""

    runtime: Runtime
    request: ResponsesRequest
    chat: ChatCall
    id: str
    created_at: int
    model: str
    input_items: list[dict[str, Any]]
    history: list[dict[str, Any]]  # the stored conversation this one continues (empty without previous_response_id)

    @property
    def stream(self) -> bool:
        return bool(self.request.stream)


def prepare_response(body: Any, runtime: Runtime) -> ResponseCall:
    """Everything that can fail before the engine runs: parsing, the stored conversation, the template."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    request = ResponsesRequest.model_validate(body)
    model = check_model(runtime, request.model or runtime.served_model_name)
    history: list[dict[str, Any]] = []
    if request.previous_response_id is not None:
        previous = runtime.responses.get(request.previous_response_id)
        if previous is None:
            raise ResponseNotFound(f"Previous response with id '{request.previous_response_id}' not found (it was "
                                   "never stored, was deleted, or was dropped from this worker's store).",
                                   param="previous_response_id")
        history = previous.context
    items = input_items(request.input, runtime.responses.item)
    chat = _chat_call(request, history + items, runtime, model)
    return ResponseCall(runtime, request, chat, new_id("resp"), int(time.time()), model, items, history)


def _chat_call(request: ResponsesRequest, conversation: list[dict[str, Any]], runtime: Runtime, model: str) -> ChatCall:
    """The chat generation behind a response; with truncation "auto", the oldest turns go until the prompt fits."""
    system = [{"role": "system", "content": request.instructions}] if request.instructions else []
    messages = chat_messages(conversation)
    spec = _text_format_spec(request)
    while True:
        call = chat_call(ChatCompletionRequest.model_validate(_chat_fields(request, system + messages, model)), runtime)
        if request.truncation != "auto" or _fits(call, runtime.max_model_len) or len(messages) <= 1:
            break
        messages = _drop_oldest_turn(messages)
    if spec is not None:
        if call.params.structured is not None:
            raise BadRequest(f"only one structured output constraint is allowed per request, got text.format and "
                             f"{call.params.structured.param}", param=call.params.structured.param)
        call.params = dataclasses.replace(call.params, structured=spec)
    return call


def _text_format_spec(request: ResponsesRequest) -> StructuredSpec | None:
    """`text.format` as the engine's constraint: json_object, or json_schema with its name and schema."""
    fmt = request.text.format if request.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredSpec("json_object", "", param="text.format")
    if not fmt.name:
        raise BadRequest("text.format.name is required for a json_schema format", param="text.format.name")
    if fmt.json_schema is None:
        raise BadRequest("text.format.schema is required for a json_schema format", param="text.format.schema")
    return StructuredSpec.json_schema(fmt.json_schema, "text.format")


def _fits(call: ChatCall, limit: int) -> bool:
    prompt, room = len(call.prompt.token_ids), call.params.max_tokens
    return prompt < limit and (room is None or prompt + room <= limit)


def _drop_oldest_turn(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Without the oldest non-system message, and without tool results whose call went with it."""
    first = next(i for i, m in enumerate(messages) if m["role"] != "system" or i == len(messages) - 1)
    rest = messages[:first] + messages[first + 1:]
    while len(rest) > 1 and rest[first:first + 1] and rest[first]["role"] == "tool":
        del rest[first]
    return rest


def _chat_fields(request: ResponsesRequest, messages: list[dict[str, Any]], model: str) -> dict[str, Any]:
    """The chat request a Responses request amounts to: the shared sampling fields plus the renamed ones."""
    fields = request.model_dump(exclude_unset=True, exclude=set(RESPONSES_ONLY))
    fields.update(model=model, messages=messages, stream=False, max_completion_tokens=request.max_output_tokens,
                  tools=chat_tools(request.tools), tool_choice=chat_tool_choice(request.tool_choice))
    if request.wants_logprobs:
        fields.update(logprobs=True, top_logprobs=request.top_logprobs or 0)
    kwargs = dict(fields.get("chat_template_kwargs") or {})
    if request.reasoning is not None and request.reasoning.effort is not None:
        kwargs.setdefault("reasoning_effort", request.reasoning.effort)
    if kwargs:
        fields["chat_template_kwargs"] = kwargs
    return {k: v for k, v in fields.items() if v is not None}


def response_object(call: ResponseCall, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `response` object: its state and output, with the request's settings echoed as OpenAI does."""
    request = call.request
    incomplete = status == "incomplete"
    text_format = request.text.format.model_dump(by_alias=True, exclude_none=True) if (
        request.text is not None and request.text.format is not None) else {"type": "text"}
    return {
        "id": call.id,
        "object": "response",
        "created_at": call.created_at,
        "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "background": False,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "max_tool_calls": request.max_tool_calls,
        "model": call.model,
        "output": output,
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": request.previous_response_id,
        "reasoning": {"effort": request.reasoning.effort if request.reasoning else None, "summary": None},
        "service_tier": "default",
        "store": request.store is not False,
        "temperature": DEFAULT_TEMPERATURE if request.temperature is None else request.temperature,
        "text": {"format": text_format, "verbosity": (request.text and request.text.verbosity) or "medium"},
        "tool_choice": request.tool_choice if request.tool_choice is not None else "auto",
        "tools": request.tools or [],
        "top_logprobs": request.top_logprobs or 0,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "truncation": request.truncation or "disabled",
        "usage": usage,
        "user": request.user,
        "metadata": request.metadata or {},
        "prompt_cache_key": request.prompt_cache_key,
        "safety_identifier": request.safety_identifier,
    }


def _usage(result: Collected) -> dict[str, Any]:
    return {
        "input_tokens": result.num_prompt_tokens,
        "input_tokens_details": {"cached_tokens": result.num_cached_tokens, "cache_write_tokens": 0},
        "output_tokens": result.num_generated_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": result.num_prompt_tokens + result.num_generated_tokens,
    }


class _Message:
    """The one output message item, built up as text arrives."""

    def __init__(self, call: ResponseCall) -> None:
        self.id = new_id("msg")
        self.top = call.request.top_logprobs or 0
        self.logprobs = call.request.wants_logprobs

    def part(self, text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    def item(self, status: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "status": status, "role": "assistant", "content": parts}

    def token_logprobs(self, positions: list[Any] | None) -> list[dict[str, Any]]:
        return chat_logprobs(positions or [], self.top)["content"] if self.logprobs else []


def _status(result: Collected) -> str:
    choice = result.choices.get(0)
    return "incomplete" if choice is not None and choice.finish_reason == "length" else "completed"


def _finish(call: ResponseCall, message: _Message, result: Collected) -> tuple[dict[str, Any], dict[str, Any]]:
    """The final output item and response; stored when the request asked for it."""
    choice = result.choices[0]
    status = _status(result)
    part = message.part(choice.text, message.token_logprobs(choice.logprobs))
    item = message.item(status, [part])
    response = response_object(call, status, [item], _usage(result))
    _store(call, response)
    return item, response


def _store(call: ResponseCall, response: dict[str, Any]) -> None:
    if call.request.store is not False:
        context = [*call.history, *call.input_items, *response["output"]]
        call.runtime.responses.put(StoredResponse(response, call.input_items, context))


async def complete_response(call: ResponseCall) -> dict[str, Any]:
    """The whole `response` object."""
    chat = call.chat
    started = await start(call.runtime.engine, chat.prompt.token_ids, chat.params, engine_request_id(call.id))
    result = await collect(started)
    return _finish(call, _Message(call), result)[1]


async def stream_response(call: ResponseCall) -> AsyncIterator[dict[str, Any]]:
    """OpenAI's event stream: created, in_progress, the item and part opened, text deltas, their closing events,
    then completed or incomplete; a failure after the first event is a `response.failed` event.

    The engine request starts before the first event, so a bad request raises instead of streaming.
    """
    chat = call.chat
    started = await start(call.runtime.engine, chat.prompt.token_ids, chat.params, engine_request_id(call.id))
    numbers = itertools.count()
    message = _Message(call)
    where = {"item_id": message.id, "output_index": 0, "content_index": 0}

    def event(kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "sequence_number": next(numbers), **fields}

    result = Collected()
    try:
        opening = response_object(call, "in_progress", [], None)
        yield event("response.created", response=opening)
        yield event("response.in_progress", response=opening)
        yield event("response.output_item.added", output_index=0, item=message.item("in_progress", []))
        yield event("response.content_part.added", **where, part=message.part("", []))
        async for output in started:
            result.add(output)
            for delta in output.outputs:
                if delta.text:
                    yield event("response.output_text.delta", **where, delta=delta.text,
                                logprobs=message.token_logprobs(delta.logprobs))
        item, response = _finish(call, message, result)
        part = item["content"][0]
        yield event("response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"])
        yield event("response.content_part.done", **where, part=part)
        yield event("response.output_item.done", output_index=0, item=item)
        yield event(f"response.{response['status']}", response=response)
    except Exception as exc:
        yield event("response.failed", response=_failed(call, exc))
    finally:
        await started.aclose()


def _failed(call: ResponseCall, exc: Exception) -> dict[str, Any]:
    body = error_body(exc)
    code = "server_error" if (status_of(body) or 500) >= 500 else "invalid_prompt"
    response = response_object(call, "failed", [], None, {"code": code, "message": body["error"]["message"]})
    _store(call, response)
    return response
