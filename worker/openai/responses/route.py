"""POST /v1/responses: a Responses API request runs as a chat generation and answers as response items.

The input items (with a stored response's conversation in front when `previous_response_id` names
one) become chat messages; the chat layer validates, renders and samples as for /v1/chat/completions;
the answer, read for reasoning and tool calls as the chat route reads it, comes back as output items
(worker/openai/responses/output.py), whole or as OpenAI's stream of events.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import AsyncGenerator
from typing import Any

from engine.outputs import RequestOutput
from engine.sample.structured.spec import StructuredSpec
from worker.openai.chat import ChatCall, chat_call, count_reasoning_tokens
from worker.openai.chat_output import OutputFormat
from worker.openai.errors import BadRequest, ResponseNotFound, error_body, status_of
from worker.openai.generation import Collected, engine_request_id
from worker.openai.models import resolve_model
from worker.openai.protocol import ChatCompletionRequest
from worker.openai.reasoning import after_reasoning
from worker.openai.responses.items import chat_messages, chat_tool_choice, chat_tools, input_items, new_id
from worker.openai.responses.output import EventFactory, OutputItems
from worker.openai.responses.request import RESPONSES_ONLY, ResponsesRequest
from worker.openai.responses.response import ResponseCall, final_usage, opening_usage, response_object, usage_object
from worker.openai.responses.store import StoredResponse
from worker.openai.responses.truncation import fit_turns
from worker.openai.runtime import Runtime
from worker.openai.stream_driver import run_to_end, stream_events
from worker.openai.tools.events import ContentDelta


def prepare_response(body: Any, runtime: Runtime) -> ResponseCall:
    """Everything that can fail before the engine runs: parsing, the stored conversation, the template."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    request = ResponsesRequest.model_validate(body)
    model, _ = resolve_model(runtime, request.model)  # the chat call runs the adapter
    if request.store is not False:
        runtime.responses.check()  # a store that is down fails the request before it runs, not after
    history: list[dict[str, Any]] = []
    if request.previous_response_id is not None:
        previous = runtime.responses.get(request.previous_response_id)
        if previous is None:
            raise ResponseNotFound(
                f"Previous response with id '{request.previous_response_id}' not found (it was "
                "never stored, was deleted, or was dropped from the store).",
                param="previous_response_id",
            )
        history = previous.context
    items = input_items(request.input, runtime.responses.item)
    chat = _chat_call(request, history + items, runtime, model, len(history))
    return ResponseCall(
        runtime=runtime,
        request=request,
        chat=chat,
        id=new_id("resp"),
        created_at=int(time.time()),
        model=model,
        input_items=items,
        history=history,
    )


def _chat_call(
    request: ResponsesRequest, conversation: list[dict[str, Any]], runtime: Runtime, model: str, inputs_from: int = 0
) -> ChatCall:
    """The chat generation behind a response; with truncation "auto", the oldest whole turns go until it fits."""
    system = [{"role": "system", "content": request.instructions}] if request.instructions else []
    harmony = runtime.tool_format == "harmony"
    messages = system + chat_messages(conversation, reasoning=harmony, inputs_from=inputs_from)
    spec = _text_format_spec(request)

    def render(kept: list[dict[str, Any]]) -> ChatCall:
        fields = _chat_fields(request, kept, model)
        if spec is not None and harmony:
            # Harmony's prompt opens the final channel (and shows a schema) only for a constraint the chat
            # layer sees: without it the grammar would hold the answer's first token, before any header.
            fields["response_format"] = _chat_response_format(request)
        return chat_call(ChatCompletionRequest.model_validate(fields), runtime)

    if request.truncation == "auto":
        call = fit_turns(messages, render, lambda c: _fits(c, runtime.max_model_len))
    else:
        call = render(messages)
    if spec is not None and harmony:  # the chat layer built it from text.format: named as the client sent it
        built = call.params.structured
        assert built is not None, "the chat layer holds the answer to text.format"
        call.params = dataclasses.replace(call.params, structured=dataclasses.replace(built, param="text.format"))
    elif spec is not None:
        if call.params.structured is not None:
            raise BadRequest(
                f"only one structured output constraint is allowed per request, got text.format and "
                f"{call.params.structured.param}",
                param=call.params.structured.param,
            )
        assert isinstance(call.output, OutputFormat), "harmony requests take the branch above"
        held = after_reasoning(spec, call.output.reasoning, call.output.in_reasoning, call.prompt.text)
        call.params = dataclasses.replace(call.params, structured=held)
    return call


def _chat_response_format(request: ResponsesRequest) -> dict[str, Any]:
    """`text.format` as chat's response_format."""
    fmt = request.text.format if request.text is not None else None
    assert fmt is not None, "asked only for a request with text.format"
    if fmt.type == "json_object":
        return {"type": "json_object"}
    return {
        "type": "json_schema",
        "json_schema": {
            "name": fmt.name,
            "schema": fmt.json_schema,
            "strict": fmt.strict,
            "description": fmt.description,
        },
    }


def _text_format_spec(request: ResponsesRequest) -> StructuredSpec | None:
    """`text.format` as the engine's constraint: json_object, or json_schema with its name and schema."""
    fmt = request.text.format if request.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredSpec(kind="json_object", value="", param="text.format")
    if not fmt.name:
        raise BadRequest("text.format.name is required for a json_schema format", param="text.format.name")
    if fmt.json_schema is None:
        raise BadRequest("text.format.schema is required for a json_schema format", param="text.format.schema")
    return StructuredSpec.json_schema(fmt.json_schema, "text.format")


def _fits(call: ChatCall, limit: int) -> bool:
    prompt, room = len(call.prompt.token_ids), call.params.max_tokens
    return prompt < limit and (room is None or prompt + room <= limit)


def _chat_fields(request: ResponsesRequest, messages: list[dict[str, Any]], model: str) -> dict[str, Any]:
    """The chat request a Responses request amounts to: the shared sampling fields plus the renamed ones."""
    fields = request.model_dump(exclude_unset=True, exclude=set(RESPONSES_ONLY))
    fields.update(
        model=model,
        messages=messages,
        stream=False,
        max_completion_tokens=request.max_output_tokens,
        tools=chat_tools(request.tools),
        tool_choice=chat_tool_choice(request.tool_choice),
        parallel_tool_calls=request.parallel_tool_calls,
    )
    if request.wants_logprobs:
        fields.update(logprobs=True, top_logprobs=request.top_logprobs or 0)
    kwargs = dict(fields.get("chat_template_kwargs") or {})
    if request.reasoning is not None and request.reasoning.effort is not None:
        kwargs.setdefault("reasoning_effort", request.reasoning.effort)
    if kwargs:
        fields["chat_template_kwargs"] = kwargs
    return {k: v for k, v in fields.items() if v is not None}


class _Answer:
    """One answer read into output items as it arrives (or whole): plain text, or parsed for calls and reasoning.

    Streamed, it is the stream driver's event builder: `event` numbers the events it makes.
    """

    def __init__(self, call: ResponseCall, event: EventFactory) -> None:
        self.call = call
        self.event = event
        request = call.request
        self.items = OutputItems(event, request.top_logprobs or 0, request.wants_logprobs)
        self.reader = None if call.chat.output.plain else call.chat.output.stream()
        self.result = Collected()

    def opening(self, first: RequestOutput) -> list[dict[str, Any]]:
        """`response.created` and `response.in_progress`, both with the response as it starts."""
        opening = response_object(self.call, "in_progress", [], opening_usage(len(self.call.chat.prompt.token_ids)))
        return [self.event("response.created", response=opening), self.event("response.in_progress", response=opening)]

    def add(self, output: RequestOutput) -> list[dict[str, Any]]:
        """Stream events for one engine output."""
        self.result.add(output)
        events: list[dict[str, Any]] = []
        for delta in output.outputs:
            if self.reader is None:
                events += self.items.push([ContentDelta(delta.text)], self.items.logprob_entries(delta.logprobs))
            else:
                events += self.items.push(self.reader.push(delta.text, delta.token_ids))
        return events

    def closing(self) -> list[dict[str, Any]]:
        """The items' closing events, then `response.completed` or `response.incomplete`."""
        events, response = self.finish()
        return [*events, self.event(f"response.{response['status']}", response=response)]

    def failed(self, exc: Exception) -> list[dict[str, Any]]:
        return [self.event("response.failed", response=_failed(self.call, exc, self.result))]

    def finish(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The closing stream events and the final response (stored when the request asked for it)."""
        choice = self.result.choices[0]
        events: list[dict[str, Any]] = []
        all_logprobs = None
        if self.reader is not None:
            events += self.items.push(self.reader.finish())
            all_logprobs = self.items.logprob_entries(choice.logprobs)
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        events += self.items.finish(status, all_logprobs)
        usage = final_usage(self.result, self._reasoning_tokens())
        response = response_object(self.call, status, self.items.items, usage)
        _store(self.call, response)
        return events, response

    def _reasoning_tokens(self) -> int:
        end = self.reader.reasoning_end if self.reader is not None else None
        return count_reasoning_tokens(self.call.chat, self.result.choices[0].token_ids, end)


def _store(call: ResponseCall, response: dict[str, Any]) -> None:
    if call.request.store is not False:
        context = [*call.history, *call.input_items, *response["output"]]
        call.runtime.responses.put(StoredResponse(response, call.input_items, context))


async def complete_response(call: ResponseCall) -> dict[str, Any]:
    """The whole `response` object."""
    chat = call.chat
    answer = _Answer(call, lambda kind, **fields: {})
    await run_to_end(
        call.runtime.engine,
        chat.prompt.token_ids,
        chat.params,
        engine_request_id(call.id),
        answer.add,
        chat.image_files,
    )
    return answer.finish()[1]


def stream_response(call: ResponseCall) -> AsyncGenerator[dict[str, Any], None]:
    """OpenAI's event stream: created and in_progress, then each output item opened, filled (text, reasoning or
    call-argument deltas) and closed, then completed or incomplete; a failure after the first event is a
    `response.failed` event.

    The engine request starts before the first event, so a bad request raises instead of streaming.
    """
    chat = call.chat
    return stream_events(
        call.runtime.engine,
        chat.prompt.token_ids,
        chat.params,
        engine_request_id(call.id),
        _Answer(call, _numbered_events()),
        chat.image_files,
    )


def _numbered_events() -> EventFactory:
    """Stream events numbered in the order they are made (`sequence_number`)."""
    numbers = itertools.count()

    def event(kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "sequence_number": next(numbers), **fields}

    return event


def _failed(call: ResponseCall, exc: Exception, result: Collected) -> dict[str, Any]:
    body = error_body(exc)
    code = "server_error" if (status_of(body) or 500) >= 500 else "invalid_prompt"
    usage = usage_object(len(call.chat.prompt.token_ids), result.num_cached_tokens, result.num_generated_tokens, 0)
    response = response_object(call, "failed", [], usage, {"code": code, "message": body["error"]["message"]})
    _store(call, response)
    return response
