"""POST /v1/responses/compact: a long conversation shortened to its user messages and one compaction item.

As OpenAI's: the output lists every user message of the conversation (the stored one `previous_response_id`
names, then `input`), then a single `compaction` item standing for the rest (answers, calls, results). Here
the compaction holds the model's own summary of the conversation, written with `truncation: "auto"` so that
a conversation longer than the context still compacts; sent back as input, it reaches the chat template as an
assistant message with that summary (worker/openai/responses/items.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from worker.openai.errors import BadRequest
from worker.openai.responses.items import compaction_content, item_text, new_id
from worker.openai.responses.response import ResponseCall
from worker.openai.responses.route import complete_response, prepare_response
from worker.openai.runtime import Runtime

SUMMARY_REQUEST = (
    "Summarize the conversation so far for your own later use: the user's goals, the facts and "
    "decisions established, results of tool calls that matter, and what is still open. Be concise."
)
SUMMARY_MAX_TOKENS = 512


class CompactRequest(BaseModel):
    """The body of POST /v1/responses/compact (OpenAI's and Open Responses' fields; any other is a 400)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]] | None = None
    previous_response_id: str | None = Field(None, min_length=1)
    instructions: str | None = None
    # Accepted and ignored, as on /v1/responses: caching and routing hints of OpenAI's platform.
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None


@dataclass
class CompactCall:
    summary: ResponseCall  # the generation that writes the summary
    user_messages: list[dict[str, Any]]


def prepare_compaction(body: Any, runtime: Runtime) -> CompactCall:
    """Everything that can fail before the engine runs, as for a response."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    request = CompactRequest.model_validate(body)
    if request.input is None and request.previous_response_id is None:
        raise BadRequest(
            "input or previous_response_id is required: there is no conversation to compact", param="input"
        )
    items = [] if request.input is None else request.input
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    summary = prepare_response(
        {
            "model": request.model,
            "input": [*items, {"type": "message", "role": "user", "content": SUMMARY_REQUEST}],
            "instructions": request.instructions,
            "previous_response_id": request.previous_response_id,
            "store": False,
            "truncation": "auto",
            "max_output_tokens": SUMMARY_MAX_TOKENS,
            "temperature": 0,
        },
        runtime,
    )
    conversation = [*summary.history, *summary.input_items[:-1]]
    users = [item for item in conversation if item["type"] == "message" and item["role"] == "user"]
    return CompactCall(summary, users)


async def complete_compaction(call: CompactCall) -> dict[str, Any]:
    """The `response.compaction` object."""
    response = await complete_response(call.summary)
    text = "\n".join(item_text(item) for item in response["output"] if item["type"] == "message")
    compaction = {"id": new_id("cmp"), "type": "compaction", "encrypted_content": compaction_content(text)}
    return {
        "id": new_id("resp"),
        "object": "response.compaction",
        "created_at": int(time.time()),
        "output": [*call.user_messages, compaction],
        "usage": response["usage"],
    }
