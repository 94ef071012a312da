"""The one place where errors become OpenAI error objects with an HTTP-style status.

Inside, code raises typed exceptions (the engine's InvalidRequest / ContextTooLong, this module's
ModelNotFound / AuthenticationFailed, pydantic's ValidationError at the request edge); `error_body`
turns any of them into `{"error": {"message", "type", "param", "code"}}` and `status_of` reads the
status back from such a body (from its type and code), so the handler yields plain OpenAI JSON and
the local server still answers with the right status code.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError

from engine.errors import ContextTooLong, EngineError, InvalidRequest, ShuttingDown

log = logging.getLogger("worker")


class WorkerError(Exception):
    """An error raised by the worker layer itself, with its OpenAI type, code and status."""

    status = 400
    type = "invalid_request_error"
    code: str | None = None
    status_in_body = True  # status_of(error_body(exc)) gives `status` back (the handler's outputs carry no status)

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class BadRequest(WorkerError):
    """A malformed request or a value out of range (400)."""


class ModelNotFound(WorkerError):
    """The request names a model this worker does not serve (404)."""

    status = 404
    code = "model_not_found"


class ResponseNotFound(WorkerError):
    """A response id that is not in this worker's store (404)."""

    status = 404
    code = "response_not_found"


class AdapterNotFound(WorkerError):
    """A LoRA adapter that is neither loaded (unload) nor found where lora_path points (load) (404)."""

    status = 404
    code = "adapter_not_found"


class RouteNotFound(WorkerError):
    """An openai_route (or URL) this worker does not serve (404)."""

    status = 404
    code = "unknown_url"


class MethodNotAllowed(WorkerError):
    """A route the local endpoint serves, called with another HTTP method (405)."""

    status = 405
    code = "method_not_allowed"


class RequestTooLarge(WorkerError):
    """A request body over the local endpoint's MAX_REQUEST_MB (413)."""

    status = 413
    code = "request_too_large"


class StoreUnavailable(WorkerError):
    """The shared response store (RESPONSE_STORE_URL) does not answer: requests that need it fail, others run."""

    status = 503
    type = "server_error"
    code = "response_store_unavailable"


class WorkerBusy(WorkerError):
    """A load-balancing worker already holds all the requests it can run (429): nothing queues in front of it, so it
    says so at once (with Retry-After) for the client to retry, rather than hold the request past RunPod's timeout."""

    status = 429
    type = "rate_limit_error"
    code = "worker_busy"


class WorkerStarting(WorkerError):
    """A load-balancing worker whose model is still loading (503, with Retry-After)."""

    status = 503
    type = "server_error"
    code = "worker_starting"


class AuthenticationFailed(WorkerError):
    """A wrong API key on the local endpoint (401)."""

    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class MissingApiKey(WorkerError):
    """No API key at all on the local endpoint (401), in OpenAI's shape for it: invalid_request_error, code null.

    NOTE: such a body says no more than a 400's, so its status cannot be read back from it (`status_in_body`); only
    the local endpoint's key check raises it, answering with the status itself, never through the handler.
    """

    status = 401
    status_in_body = False


def _param_of(loc: tuple[Any, ...]) -> str | None:
    """pydantic's error location as OpenAI writes params: messages.[0].content."""
    parts = [f"[{p}]" if isinstance(p, int) else str(p) for p in loc]
    return ".".join(parts) or None


def _describe_validation(exc: ValidationError) -> tuple[str, str | None]:
    error = exc.errors()[0]
    loc = tuple(p for p in error["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    param = _param_of(loc)
    if error["type"] == "missing":
        return f"Missing required parameter: '{param}'.", param
    # Unions report the branch they tried (e.g. "str"); that is noise for a client.
    loc = tuple(p for p in loc if p not in {"str", "list[str]", "list[int]", "list[list[int]]", "int", "float"})
    param = _param_of(loc)
    message = error["msg"].removeprefix("Value error, ")
    return (f"Invalid value for '{param}': {message}" if param else message), param


def error_body(exc: BaseException) -> dict[str, Any]:
    """The OpenAI error object for any exception; unexpected ones are logged with their stack, not shown."""
    if isinstance(exc, WorkerError):
        return _body(exc.message, exc.type, exc.param, exc.code, exc.status if exc.status_in_body else None)
    if isinstance(exc, ValidationError):
        message, param = _describe_validation(exc)
        return _body(message, "invalid_request_error", param, None, 400)
    if isinstance(exc, ShuttingDown):
        return _body(exc.message, "server_error", None, "worker_shutting_down", 503)
    if isinstance(exc, ContextTooLong):
        return _body(exc.message, "invalid_request_error", exc.param, "context_length_exceeded", 400)
    if isinstance(exc, InvalidRequest):
        return _body(exc.message, "invalid_request_error", exc.param, None, 400)
    if isinstance(exc, EngineError):  # the engine's own fault, said plainly: the request itself was fine
        log.error("engine error while serving a request: %s", exc.message)
        return _body(f"Internal server error: {exc.message}.", "server_error", None, None, 500)
    log.exception("unexpected error while serving a request", exc_info=exc)
    return _body(f"Internal server error ({type(exc).__name__}).", "server_error", None, None, 500)


def _body(message: str, type_: str, param: str | None, code: str | None, status: int | None) -> dict[str, Any]:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    if status is not None and status_of(body) != status:  # the status travels in type and code only: they must say it
        raise RuntimeError(f"error type {type_!r} / code {code!r} does not map to HTTP status {status}")
    return body


_STATUS_BY_CODE = {
    "model_not_found": 404,
    "adapter_not_found": 404,
    "unknown_url": 404,
    "response_not_found": 404,
    "worker_shutting_down": 503,
    "worker_starting": 503,
    "worker_busy": 429,
    "response_store_unavailable": 503,
    "request_too_large": 413,
    "method_not_allowed": 405,
}
_STATUS_BY_TYPE = {
    "authentication_error": 401,
    "server_error": 500,
    # Anthropic's error types (the Messages API's errors, worker/anthropic/errors.py)
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "overloaded_error": 529,
}


def status_of(body: Any) -> int | None:
    """The HTTP status of an OpenAI (or Anthropic) error body, or None when `body` is not one."""
    if not (isinstance(body, dict) and isinstance(body.get("error"), dict)):
        return None
    error = body["error"]
    return _STATUS_BY_CODE.get(error.get("code")) or _STATUS_BY_TYPE.get(error.get("type"), 400)
