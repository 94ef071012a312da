"""Validate responses and stream chunks against OpenAI's OpenAPI spec, as generated into `openapiopenai`.

`openapiopenai` (PyPI) is OpenAI's published OpenAPI document compiled into pydantic models: required
fields, strict types and enums as the spec states them. `model_validate` (not the lenient `from_dict`)
is used so that a missing required key fails too. Extra keys (vLLM's `stop_reason`, `token_ids`, ...)
are allowed, as in the spec.

`openapiopenai` predates the Responses API, so Responses objects and events are validated with the
official SDK's types, which OpenAI generates from the same spec (`openai.types.responses`), through
`model_validate` as well. Where the spec says a field is a string that may be absent
(`system_fingerprint`), a null is refused here, as the spec refuses it.
"""

from __future__ import annotations

import json
from typing import Any

from openai.types.responses import Response, ResponseItemList, ResponseStreamEvent
from openapiopenai.models.create_chat_completion_response import CreateChatCompletionResponse
from openapiopenai.models.create_chat_completion_stream_response import CreateChatCompletionStreamResponse
from openapiopenai.models.create_completion_response import CreateCompletionResponse
from openapiopenai.models.error_response import ErrorResponse
from openapiopenai.models.list_models_response import ListModelsResponse
from openapiopenai.models.model import Model
from pydantic import TypeAdapter

SCHEMAS = {
    "chat.completion": CreateChatCompletionResponse,
    "chat.completion.chunk": CreateChatCompletionStreamResponse,
    "list": ListModelsResponse,
    "model": Model,
    "response": Response,
}
EVENTS = TypeAdapter(ResponseStreamEvent)
# Fields the spec types as a string that may be absent, never null.
NOT_NULL = ("system_fingerprint",)


def validate(obj: Any) -> Any:
    """Validate one response object or chunk by its `object` field (errors by their shape); return it."""
    if hasattr(obj, "model_dump"):
        obj = obj.model_dump(exclude_unset=True, by_alias=True)
    if "error" in obj and obj.get("object") != "response":
        ErrorResponse.model_validate(obj)
        return obj
    for name in NOT_NULL:
        assert obj.get(name, "") is not None, f"{name} is null; the spec allows a string or no key"
    if "object" not in obj and str(obj.get("type", "")).startswith("response."):
        EVENTS.validate_python(obj)
        return obj
    kind = obj["object"]
    if kind == "list" and obj.get("data") and "type" in obj["data"][0]:
        ResponseItemList.model_validate(obj)
    elif kind == "text_completion":
        CreateCompletionResponse.model_validate(_spec_gaps(obj))
    else:
        SCHEMAS[kind].model_validate(obj)
    return obj


def _spec_gaps(obj: dict[str, Any]) -> dict[str, Any]:
    """Two places where OpenAI's live completions API (and vLLM) differ from its spec, filled to pass.

    The spec has no chunk type for streamed completions (each chunk is a CreateCompletionResponse),
    yet every chunk before a choice's last carries `finish_reason: null`; and echoed prompts start
    with a token whose logprob is null. Only those two nulls are replaced; everything else is checked.
    """
    obj = json.loads(json.dumps(obj))
    for choice in obj["choices"]:
        if choice.get("finish_reason") is None:
            choice["finish_reason"] = "length"
        logprobs = choice.get("logprobs")
        if logprobs and logprobs["token_logprobs"] and logprobs["token_logprobs"][0] is None:
            logprobs["token_logprobs"][0] = 0.0
            logprobs["top_logprobs"][0] = {}
    return obj


def parse_events(text: str) -> list[dict[str, Any]]:
    """The named events of a Responses API SSE body: each `event:` name must equal its data's `type`."""
    out = []
    for block in filter(str.strip, text.split("\n\n")):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        assert lines.get("event") == data.get("type", "error"), block[:200]
        out.append(data)
    return out


def parse_sse(text: str) -> list[Any]:
    """The events of an SSE body; the last must be [DONE], which is dropped."""
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line.strip()]
    assert events and events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]
