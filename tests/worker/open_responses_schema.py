"""The Open Responses specification's schema for the objects /v1/responses returns, written down from the
spec (openresponses.org, `ResponseResource`, `Message`, `FunctionTool`, `JsonSchemaResponseFormat`, `Usage`,
`CompactResource`, release 2026-04-24) for the fields this worker has been found to miss, plus the nulls
OpenAI's published schema refuses (`usage`, `user`).

Open Responses validates with zod objects that allow extra keys, so extra keys are allowed here as well.
"""

from __future__ import annotations

from typing import Any

import jsonschema


def _nullable(kind: str | list[str]) -> dict[str, Any]:
    return {"type": [*([kind] if isinstance(kind, str) else kind), "null"]}


def _object(required: list[str], **properties: Any) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": properties}


USAGE = _object(
    ["input_tokens", "output_tokens", "total_tokens", "input_tokens_details", "output_tokens_details"],
    input_tokens={"type": "integer"},
    output_tokens={"type": "integer"},
    total_tokens={"type": "integer"},
    input_tokens_details=_object(["cached_tokens"], cached_tokens={"type": "integer"}),
    output_tokens_details=_object(["reasoning_tokens"], reasoning_tokens={"type": "integer"}),
)
MESSAGE = _object(
    ["type", "id", "status", "role", "content"],
    type={"const": "message"},
    id={"type": "string"},
    status={"enum": ["in_progress", "completed", "incomplete"]},
    role={"enum": ["user", "assistant", "system", "developer"]},
    phase={"enum": ["commentary", "final_answer"]},
    content={"type": "array"},
)
FUNCTION_CALL = _object(
    ["type", "id", "call_id", "name", "arguments", "status"],
    type={"const": "function_call"},
    arguments={"type": "string"},
    status={"enum": ["in_progress", "completed", "incomplete"]},
)
REASONING = _object(["type", "id", "summary"], type={"const": "reasoning"}, summary={"type": "array"})
COMPACTION = _object(
    ["type", "id", "encrypted_content"], type={"const": "compaction"}, encrypted_content={"type": "string"}
)
ITEM = {"anyOf": [MESSAGE, FUNCTION_CALL, REASONING, COMPACTION]}
FUNCTION_TOOL = _object(
    ["type", "name", "description", "parameters", "strict"],
    type={"const": "function"},
    name={"type": "string"},
    description=_nullable("string"),
    parameters=_nullable("object"),
    strict=_nullable("boolean"),
)
TEXT_FORMAT = {
    "anyOf": [
        _object(["type"], type={"enum": ["text", "json_object"]}),
        _object(
            ["type", "name", "description", "schema", "strict"],
            type={"const": "json_schema"},
            name={"type": "string"},
            description=_nullable("string"),
            schema=_nullable("object"),
            strict={"type": "boolean"},
        ),
    ]
}
RESPONSE = _object(
    [
        "id",
        "object",
        "created_at",
        "completed_at",
        "status",
        "incomplete_details",
        "model",
        "previous_response_id",
        "instructions",
        "output",
        "error",
        "tools",
        "tool_choice",
        "truncation",
        "parallel_tool_calls",
        "text",
        "top_p",
        "presence_penalty",
        "frequency_penalty",
        "top_logprobs",
        "temperature",
        "reasoning",
        "usage",
        "max_output_tokens",
        "max_tool_calls",
        "store",
        "background",
        "service_tier",
        "metadata",
        "safety_identifier",
        "prompt_cache_key",
    ],
    object={"const": "response"},
    created_at={"type": "integer"},
    completed_at=_nullable("integer"),
    output={"type": "array", "items": ITEM},
    tools={"type": "array", "items": FUNCTION_TOOL},
    truncation={"enum": ["auto", "disabled"]},
    parallel_tool_calls={"type": "boolean"},
    text=_object(["format"], format=TEXT_FORMAT),
    top_p={"type": "number"},
    presence_penalty={"type": "number"},
    frequency_penalty={"type": "number"},
    top_logprobs={"type": "integer"},
    temperature={"type": "number"},
    reasoning={"anyOf": [_object(["effort", "summary"]), {"type": "null"}]},
    # Open Responses allows a null usage; OpenAI's published schema does not, so an object is required here.
    usage=USAGE,
    max_output_tokens=_nullable("integer"),
    max_tool_calls=_nullable("integer"),
    store={"type": "boolean"},
    background={"type": "boolean"},
    service_tier={"type": "string"},
    safety_identifier=_nullable("string"),
    prompt_cache_key=_nullable("string"),
    user={"type": "string"},  # OpenAI's published schema: a string or no key, never null
)
COMPACT_RESOURCE = _object(
    ["id", "object", "output", "created_at", "usage"],
    id={"type": "string"},
    object={"const": "response.compaction"},
    output={"type": "array", "items": ITEM},
    created_at={"type": "integer"},
    usage=USAGE,
)


def check_response(obj: dict[str, Any]) -> dict[str, Any]:
    jsonschema.validate(obj, RESPONSE)
    return obj


def check_compaction(obj: dict[str, Any]) -> dict[str, Any]:
    jsonschema.validate(obj, COMPACT_RESOURCE)
    return obj
