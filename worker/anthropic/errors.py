"""Errors of the Messages API in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.

The worker's typed exceptions become OpenAI error objects in one place (worker/openai/errors.py); this module
restates such an object in Anthropic's words, keeping its status: Anthropic's error types name statuses as
OpenAI's do (worker/openai/errors.status_of reads both), so the local endpoint answers with the same code.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from worker.openai.errors import error_body, status_of

MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
# Anthropic's error types by HTTP status; a worker that is shutting down (503) is "overloaded" (529), which
# Anthropic's clients retry.
TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def is_messages_route(route: str) -> bool:
    """Whether a route (`/v1/messages`, also under a URL prefix such as /v2/<id>/openai) is the Messages API's."""
    path = route.rstrip("/")
    return path.endswith(MESSAGES) or path.endswith(COUNT_TOKENS)


def anthropic_error(exc: BaseException) -> dict[str, Any]:
    """The Messages API's error object for any exception."""
    return anthropic_shape(error_body(exc))


def anthropic_shape(body: dict[str, Any], status: int | None = None) -> dict[str, Any]:
    """An OpenAI error object said in Anthropic's shape, with the `request_id` Anthropic's schema requires (one of
    its own: an error may come before any message id exists). Anthropic's error has no `param`: the message names
    the field instead, as Anthropic's do (`messages.0.content.1: ...`). `status`: where the body's type and code do
    not say it (worker/openai/errors.py)."""
    status = status or status_of(body) or 500
    kind = TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {
        "type": "error",
        "error": {"type": kind, "message": _naming_the_field(body["error"])},
        "request_id": f"req_{uuid.uuid4().hex[:24]}",
    }


def _naming_the_field(error: dict[str, Any]) -> str:
    """The message, led by the field it is about in Anthropic's dotted form unless it already names it."""
    message, param = error["message"], error.get("param")
    if not param:
        return message
    field = re.sub(r"\.?\[(\d+)\]", r".\1", param)  # OpenAI's messages.[0].content is messages.0.content here
    return message if message.startswith(field) else f"{field}: {message}"
