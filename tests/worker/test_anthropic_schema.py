"""The Anthropic-schema checker itself: its tables match the installed SDK's types, and it refuses what breaks
the schema (a missing field, an unknown one, a value outside an enum, events out of order). Also the worker's own
error objects, which it builds without a model, held to it."""

from __future__ import annotations

import copy

import pytest
from anthropic import types
from anthropic.types import shared
from anthropic.types.raw_message_delta_event import Delta
from anthropic_schema import SCHEMAS, SchemaError, check, check_error, check_message, check_stream

from worker.anthropic.errors import anthropic_error, anthropic_shape
from worker.openai.errors import BadRequest, ModelNotFound, RequestTooLarge, StoreUnavailable, error_body

SDK = {
    "Message": types.Message,
    "Usage": types.Usage,
    "MessageDeltaUsage": types.MessageDeltaUsage,
    "CacheCreation": types.CacheCreation,
    "ServerToolUsage": types.ServerToolUsage,
    "OutputTokensDetails": types.OutputTokensDetails,
    "TextBlock": types.TextBlock,
    "ThinkingBlock": types.ThinkingBlock,
    "RedactedThinkingBlock": types.RedactedThinkingBlock,
    "ToolUseBlock": types.ToolUseBlock,
    "DirectCaller": types.DirectCaller,
    "MessageTokensCount": types.MessageTokensCount,
    "ErrorResponse": shared.ErrorResponse,
    "RawMessageStartEvent": types.RawMessageStartEvent,
    "RawContentBlockStartEvent": types.RawContentBlockStartEvent,
    "RawContentBlockDeltaEvent": types.RawContentBlockDeltaEvent,
    "RawContentBlockStopEvent": types.RawContentBlockStopEvent,
    "RawMessageDeltaEvent": types.RawMessageDeltaEvent,
    "MessageDelta": Delta,
    "RawMessageStopEvent": types.RawMessageStopEvent,
    "TextDelta": types.TextDelta,
    "InputJSONDelta": types.InputJSONDelta,
    "ThinkingDelta": types.ThinkingDelta,
    "SignatureDelta": types.SignatureDelta,
    "RefusalStopDetails": types.RefusalStopDetails,
    "Container": types.Container,
}


@pytest.mark.parametrize("name", sorted(SDK))
def test_the_tables_name_the_sdks_fields(name) -> None:
    required, optional = SCHEMAS[name]
    fields = SDK[name].model_fields
    assert set(required) | set(optional) == set(fields)
    assert {f for f, info in fields.items() if info.is_required()} <= set(required)


USAGE = {
    "input_tokens": 3,
    "output_tokens": 2,
    "cache_creation_input_tokens": 0,
    "cache_read_input_tokens": 0,
    "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
    "inference_geo": None,
    "output_tokens_details": None,
    "server_tool_use": {"web_search_requests": 0, "web_fetch_requests": 0},
    "service_tier": "standard",
}
MESSAGE = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "model": "m",
    "stop_reason": "end_turn",
    "stop_sequence": None,
    "stop_details": None,
    "container": None,
    "usage": USAGE,
    "content": [
        {"type": "text", "text": "Hi", "citations": None},
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}, "caller": {"type": "direct"}},
    ],
}


def _broken(path: list, value=None, delete: bool = False) -> dict:
    out = copy.deepcopy(MESSAGE)
    node = out
    for key in path[:-1]:
        node = node[key]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


def test_a_valid_message_passes() -> None:
    check_message(MESSAGE)
    types.Message.model_validate(MESSAGE)  # and the SDK reads it


@pytest.mark.parametrize(
    ("path", "value", "delete", "words"),
    [
        (["stop_sequence"], None, True, "required field 'stop_sequence'"),
        (["usage", "service_tier"], None, True, "required field 'service_tier'"),
        (["usage", "cache_creation"], None, True, "required field 'cache_creation'"),
        (["content", 0, "citations"], None, True, "required field 'citations'"),
        (["content", 1, "caller"], None, True, "required field 'caller'"),
        (["usage", "cached_tokens"], 1, False, "no field 'cached_tokens'"),
        (["content", 0, "index"], 0, False, "no field 'index'"),
        (["stop_reason"], "stop", False, "must be one of"),
        (["usage", "service_tier"], "premium", False, "must be one of"),
        (["usage", "input_tokens"], "3", False, "must be integer"),
        (["content", 1, "input"], "{}", False, "must be object"),
        (["content", 0, "type"], "image", False, "type must be one of"),
        (["stop_reason"], "stop_sequence", False, "stop_sequence"),
    ],
)
def test_a_broken_message_fails_naming_the_field(path, value, delete, words) -> None:
    with pytest.raises(SchemaError, match=words):
        check_message(_broken(path, value, delete))


START = {"type": "message_start", "message": {**MESSAGE, "content": [], "stop_reason": None}}
DELTA_USAGE = {
    k: USAGE[k]
    for k in (
        "input_tokens",
        "output_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
        "output_tokens_details",
        "server_tool_use",
    )
}
STREAM = [
    START,
    {"type": "ping"},
    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": "", "citations": None}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}},
    {"type": "content_block_stop", "index": 0},
    {
        "type": "message_delta",
        "usage": DELTA_USAGE,
        "delta": {"stop_reason": "end_turn", "stop_sequence": None, "stop_details": None, "container": None},
    },
    {"type": "message_stop"},
]


def test_a_stream_is_checked_event_by_event_and_in_order() -> None:
    check_stream(STREAM)
    with pytest.raises(SchemaError, match="no field 'cache_creation'"):
        check_stream([*STREAM[:5], {**STREAM[5], "usage": USAGE}, STREAM[6]])  # the whole usage in message_delta
    with pytest.raises(SchemaError, match="input_json_delta in a text block"):
        check_stream(
            [*STREAM[:3], {**STREAM[3], "delta": {"type": "input_json_delta", "partial_json": "{"}}, *STREAM[4:]]
        )
    with pytest.raises(SchemaError, match="no such block is open"):
        check_stream([*STREAM[:3], {**STREAM[3], "index": 1}, *STREAM[4:]])
    with pytest.raises(SchemaError, match="closes with message_delta"):
        check_stream(STREAM[:-1])
    with pytest.raises(SchemaError, match="opens with message_start"):
        check_stream(STREAM[1:])


@pytest.mark.parametrize(
    "exc",
    [
        BadRequest("messages.0: bad", param="messages.0"),
        ModelNotFound("no such model"),
        RequestTooLarge("too big"),
        StoreUnavailable("down"),
        RuntimeError("boom"),
    ],
)
def test_the_workers_error_objects_follow_the_schema(exc) -> None:
    check_error(anthropic_error(exc))
    check(anthropic_shape(error_body(exc)), "ErrorResponse")
