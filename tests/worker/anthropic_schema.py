"""A strict checker of Anthropic Messages API responses and stream events, written from Anthropic's published schema.

Anthropic's SDKs are generated from its OpenAPI schema. The TypeScript SDK keeps the schema's distinction between a
required field that may be null (`stop_sequence: string | null`) and an optional one (`toolset_name?: ...`); the
Python SDK's pydantic types (`anthropic.types`) give the same fields, all nullable ones as `Optional[...] = None`.
The tables below follow the TypeScript SDK's required fields and the installed Python SDK's field sets
(test_anthropic_schema.py holds the two to each other). Strict: every required field present with its type, no
field the schema does not name, enums as published. `check_stream` also checks the events' order and indices.
"""

from __future__ import annotations

import json
from typing import Any

import httpx2

STOP_REASONS = (
    "end_turn",
    "max_tokens",
    "stop_sequence",
    "tool_use",
    "pause_turn",
    "refusal",
    "model_context_window_exceeded",
)
# ErrorType as published, plus `request_too_large`, which Anthropic's errors page gives for a 413 (the SDK's
# union leaves it out).
ERROR_TYPES = (
    "invalid_request_error",
    "authentication_error",
    "billing_error",
    "permission_error",
    "not_found_error",
    "rate_limit_error",
    "timeout_error",
    "api_error",
    "overloaded_error",
    "request_too_large",
)

STR, INT, BOOL, OBJ, ANY = "string", "integer", "boolean", "object", "any"


def const(value: str) -> tuple:
    return ("enum", (value,))


def enum(*values: str) -> tuple:
    return ("enum", values)


def null(spec: Any) -> tuple:
    return ("nullable", spec)


def array(spec: Any) -> tuple:
    return ("array", spec)


def ref(name: str) -> tuple:
    return ("ref", name)


def union(**by_type: str) -> tuple:
    """One of several objects, told apart by their `type`."""
    return ("union", by_type)


# Each schema: (required fields, optional fields), each a {name: spec}.
CONTENT_BLOCK = union(
    text="TextBlock", thinking="ThinkingBlock", redacted_thinking="RedactedThinkingBlock", tool_use="ToolUseBlock"
)
SCHEMAS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "Message": (
        {
            "id": STR,
            "type": const("message"),
            "role": const("assistant"),
            "model": STR,
            "content": array(CONTENT_BLOCK),
            "stop_reason": null(enum(*STOP_REASONS)),
            "stop_sequence": null(STR),
            "stop_details": null(ref("RefusalStopDetails")),
            "container": null(ref("Container")),
            "usage": ref("Usage"),
        },
        {"diagnostics": null(OBJ)},
    ),
    "Usage": (
        {
            "input_tokens": INT,
            "output_tokens": INT,
            "cache_creation_input_tokens": null(INT),
            "cache_read_input_tokens": null(INT),
            "cache_creation": null(ref("CacheCreation")),
            "inference_geo": null(STR),
            "output_tokens_details": null(ref("OutputTokensDetails")),
            "server_tool_use": null(ref("ServerToolUsage")),
            "service_tier": null(enum("standard", "priority", "batch")),
        },
        {"speed": null(enum("standard", "fast"))},
    ),
    "MessageDeltaUsage": (
        {
            "input_tokens": null(INT),
            "output_tokens": INT,
            "cache_creation_input_tokens": null(INT),
            "cache_read_input_tokens": null(INT),
            "output_tokens_details": null(ref("OutputTokensDetails")),
            "server_tool_use": null(ref("ServerToolUsage")),
        },
        {},
    ),
    "CacheCreation": ({"ephemeral_5m_input_tokens": INT, "ephemeral_1h_input_tokens": INT}, {}),
    "ServerToolUsage": ({"web_search_requests": INT, "web_fetch_requests": INT}, {}),
    "OutputTokensDetails": ({"thinking_tokens": INT}, {}),
    "RefusalStopDetails": ({"type": const("refusal"), "category": null(STR), "explanation": null(STR)}, {}),
    "Container": ({"id": STR, "expires_at": STR, "skills": null(array(OBJ))}, {}),
    "TextBlock": ({"type": const("text"), "text": STR, "citations": null(array(OBJ))}, {}),
    "ThinkingBlock": ({"type": const("thinking"), "thinking": STR, "signature": STR}, {}),
    "RedactedThinkingBlock": ({"type": const("redacted_thinking"), "data": STR}, {}),
    "ToolUseBlock": (
        {"type": const("tool_use"), "id": STR, "name": STR, "input": OBJ, "caller": union(direct="DirectCaller")},
        {"toolset_name": null(STR)},
    ),
    "DirectCaller": ({"type": const("direct")}, {}),
    "MessageTokensCount": ({"input_tokens": INT}, {}),
    "ErrorResponse": ({"type": const("error"), "error": ref("ErrorObject"), "request_id": null(STR)}, {}),
    "ErrorObject": ({"type": enum(*ERROR_TYPES), "message": STR}, {}),
    # Stream events
    "RawMessageStartEvent": ({"type": const("message_start"), "message": ref("Message")}, {}),
    "RawContentBlockStartEvent": (
        {"type": const("content_block_start"), "index": INT, "content_block": CONTENT_BLOCK},
        {},
    ),
    "RawContentBlockDeltaEvent": (
        {
            "type": const("content_block_delta"),
            "index": INT,
            "delta": union(
                text_delta="TextDelta",
                input_json_delta="InputJSONDelta",
                thinking_delta="ThinkingDelta",
                signature_delta="SignatureDelta",
            ),
        },
        {},
    ),
    "RawContentBlockStopEvent": ({"type": const("content_block_stop"), "index": INT}, {}),
    "RawMessageDeltaEvent": (
        {"type": const("message_delta"), "delta": ref("MessageDelta"), "usage": ref("MessageDeltaUsage")},
        {},
    ),
    "MessageDelta": (
        {
            "stop_reason": null(enum(*STOP_REASONS)),
            "stop_sequence": null(STR),
            "stop_details": null(ref("RefusalStopDetails")),
            "container": null(ref("Container")),
        },
        {},
    ),
    "RawMessageStopEvent": ({"type": const("message_stop")}, {}),
    "PingEvent": ({"type": const("ping")}, {}),
    "TextDelta": ({"type": const("text_delta"), "text": STR}, {}),
    "InputJSONDelta": ({"type": const("input_json_delta"), "partial_json": STR}, {}),
    "ThinkingDelta": ({"type": const("thinking_delta"), "thinking": STR}, {}),
    "SignatureDelta": ({"type": const("signature_delta"), "signature": STR}, {}),
}
EVENTS = {
    "message_start": "RawMessageStartEvent",
    "content_block_start": "RawContentBlockStartEvent",
    "content_block_delta": "RawContentBlockDeltaEvent",
    "content_block_stop": "RawContentBlockStopEvent",
    "message_delta": "RawMessageDeltaEvent",
    "message_stop": "RawMessageStopEvent",
    "ping": "PingEvent",
    "error": "ErrorResponse",
}
# Which delta fills which block.
DELTAS = {"text": {"text_delta"}, "thinking": {"thinking_delta", "signature_delta"}, "tool_use": {"input_json_delta"}}


class SchemaError(AssertionError):
    """A value that breaks Anthropic's schema; the message names where."""


def check(value: Any, name: str, where: str = "$") -> None:
    """`value` is a valid instance of the schema `name`."""
    required, optional = SCHEMAS[name]
    if not isinstance(value, dict):
        raise SchemaError(f"{where}: a {name} must be an object, got {value!r}")
    for field in required:
        if field not in value:
            raise SchemaError(f"{where}: {name} lacks the required field {field!r}")
    for field, item in value.items():
        spec = required.get(field, optional.get(field))
        if spec is None:
            raise SchemaError(f"{where}: {name} has no field {field!r}")
        _check_spec(item, spec, f"{where}.{field}")


def _check_spec(value: Any, spec: Any, where: str) -> None:
    if isinstance(spec, str):
        ok = {
            STR: isinstance(value, str),
            BOOL: isinstance(value, bool),
            OBJ: isinstance(value, dict),
            ANY: True,
            INT: isinstance(value, int) and not isinstance(value, bool),
        }[spec]
        if not ok:
            raise SchemaError(f"{where}: must be {spec}, got {value!r}")
        return
    kind, arg = spec
    if kind == "nullable":
        if value is not None:
            _check_spec(value, arg, where)
    elif kind == "enum":
        if value not in arg:
            raise SchemaError(f"{where}: must be one of {list(arg)}, got {value!r}")
    elif kind == "array":
        if not isinstance(value, list):
            raise SchemaError(f"{where}: must be an array, got {value!r}")
        for i, item in enumerate(value):
            _check_spec(item, arg, f"{where}.{i}")
    elif kind == "ref":
        check(value, arg, where)
    elif kind == "union":
        kind_of = value.get("type") if isinstance(value, dict) else None
        if kind_of not in arg:
            raise SchemaError(f"{where}: type must be one of {list(arg)}, got {kind_of!r}")
        check(value, arg[kind_of], where)


def check_message(value: Any) -> None:
    check(value, "Message")
    if value["stop_reason"] is None:
        raise SchemaError("$.stop_reason: a whole message always has one")
    if (value["stop_reason"] == "stop_sequence") != (value["stop_sequence"] is not None):
        raise SchemaError("$.stop_sequence: set exactly when stop_reason is 'stop_sequence'")


def check_error(value: Any) -> None:
    check(value, "ErrorResponse")


def check_event(event: Any) -> None:
    kind = event.get("type") if isinstance(event, dict) else None
    if kind not in EVENTS:
        raise SchemaError(f"an event of unknown type {kind!r}: {event!r}")
    check(event, EVENTS[kind])


def check_stream(events: list[dict[str, Any]]) -> None:
    """Every event valid, in Anthropic's order: message_start, blocks 0, 1, ... each started, filled with its own
    kind of delta and stopped, then message_delta and message_stop; pings anywhere, an error ends the stream."""
    for event in events:
        check_event(event)
    kinds = [e["type"] for e in events if e["type"] != "ping"]
    if not kinds or kinds[0] != "message_start":
        raise SchemaError(f"a stream opens with message_start, got {kinds[:1]}")
    start = events[[e["type"] for e in events].index("message_start")]
    if start["message"]["content"] != [] or start["message"]["stop_reason"] is not None:
        raise SchemaError("message_start carries the message with no content and no stop_reason yet")
    if kinds[-1] == "error":
        return
    if kinds[-2:] != ["message_delta", "message_stop"]:
        raise SchemaError(f"a stream closes with message_delta, message_stop, got {kinds[-2:]}")
    open_block: dict[str, Any] | None = None
    next_index = 0
    for event in events:
        kind = event["type"]
        if kind == "content_block_start":
            if open_block is not None or event["index"] != next_index:
                raise SchemaError(f"content_block_start {event['index']}: blocks open one at a time, in order")
            open_block, next_index = event, next_index + 1
        elif kind in ("content_block_delta", "content_block_stop"):
            if open_block is None or event["index"] != open_block["index"]:
                raise SchemaError(f"{kind} {event['index']}: no such block is open")
            if kind == "content_block_stop":
                open_block = None
            elif event["delta"]["type"] not in DELTAS[open_block["content_block"]["type"]]:
                raise SchemaError(f"a {event['delta']['type']} in a {open_block['content_block']['type']} block")
        elif kind == "message_delta" and open_block is not None:
            raise SchemaError("message_delta while a block is open")
    if events[[e["type"] for e in events].index("message_delta")]["delta"]["stop_reason"] is None:
        raise SchemaError("message_delta carries the stop_reason")


def sse_events(text: str) -> list[dict[str, Any]]:
    """The events of an SSE body, each `event:` name checked against its data's type."""
    events, name = [], None
    for line in text.splitlines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            event = json.loads(line.removeprefix("data: "))
            if name != event.get("type"):
                raise SchemaError(f"SSE event {name!r} carries data of type {event.get('type')!r}")
            events.append(event)
            name = None
    return events


def check_reply(path: str, status: int, content_type: str, body: bytes) -> None:
    """One HTTP reply of the Messages API, by its route and status."""
    if content_type.startswith("text/event-stream"):
        check_stream(sse_events(body.decode()))
    elif status >= 400:
        check_error(json.loads(body))
    elif path.rstrip("/").endswith("/count_tokens"):
        check(json.loads(body), "MessageTokensCount")
    else:
        check_message(json.loads(body))


class CheckedTransport(httpx2.BaseTransport):
    """An httpx2 transport (the HTTP client the anthropic SDK is built on) that keeps a copy of every reply's body as
    the client reads it; `verify()` holds each reply so far to the schema."""

    def __init__(self) -> None:
        self.inner = httpx2.HTTPTransport()
        self.replies: list[tuple[str, int, str, bytearray]] = []

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response = self.inner.handle_request(request)
        body = bytearray()
        self.replies.append((request.url.path, response.status_code, response.headers.get("content-type", ""), body))
        return httpx2.Response(
            response.status_code,
            headers=response.headers,
            stream=_Tee(response.stream, body),
            extensions=response.extensions,
            request=request,
        )

    def verify(self) -> int:
        """Check every reply read since the last call; how many there were."""
        replies, self.replies = self.replies, []
        for path, status, content_type, body in replies:
            check_reply(path, status, content_type, bytes(body))
        return len(replies)

    def close(self) -> None:
        self.inner.close()


class _Tee(httpx2.SyncByteStream):
    def __init__(self, stream: Any, copy: bytearray) -> None:
        self.stream, self.copy = stream, copy

    def __iter__(self):
        for chunk in self.stream:
            self.copy += chunk
            yield chunk

    def close(self) -> None:
        self.stream.close()
