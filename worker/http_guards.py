"""What stands in front of the local endpoint's routes: the request size limit and the API key check.

NOTE: plain ASGI middlewares; FastAPI's @app.middleware("http") would hide a client's disconnect from the
routes, which need to see it to abort the request.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

from fastapi.responses import JSONResponse

from worker.anthropic.errors import anthropic_shape, is_messages_route
from worker.openai.errors import (
    AuthenticationFailed,
    MissingApiKey,
    RequestTooLarge,
    WorkerError,
    error_body,
    status_of,
)

# OpenAI's and Anthropic's words for a request that carries no key at all (a wrong one is "Incorrect API key").
NO_KEY = (
    "You didn't provide an API key. You need to provide your API key in an Authorization header using Bearer "
    "auth (i.e. Authorization: Bearer YOUR_KEY)."
)
NO_KEY_ANTHROPIC = "x-api-key header is required"


def error_response(exc: Exception, headers: Mapping[str, str] | None = None, path: str = "") -> JSONResponse:
    """The error answer for `exc`: OpenAI's error object, or Anthropic's on the Messages API's `path`s."""
    body = error_body(exc)
    status = exc.status if isinstance(exc, WorkerError) else status_of(body) or 500
    return JSONResponse(
        anthropic_shape(body, status) if is_messages_route(path) else body, status_code=status, headers=headers
    )


class BodyTooLarge(Exception):
    """A request body went past the size limit while it was being read."""


class BodyLimit:
    """Refuses a request body over `max_bytes` with a 413 before reading it whole: at once when Content-Length
    says so, else as soon as the bytes read pass the limit (chunked uploads)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"").decode("latin-1")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        seen = 0
        started = False

        async def counting_receive() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise BodyTooLarge
            return message

        async def tracking_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._refuse(scope, receive, send)

    async def _refuse(self, scope: dict, receive: Any, send: Any) -> None:
        too_large = RequestTooLarge(
            f"The request body is larger than this worker accepts ({self.max_bytes} bytes, MAX_REQUEST_MB)."
        )
        await error_response(too_large, {"Connection": "close"}, scope["path"])(scope, receive, send)


class ApiKeyGuard:
    """Every route but the `open_routes` (/health) needs `Authorization: Bearer <key>`, or `x-api-key: <key>` as
    Anthropic's clients send it.

    NOTE: a plain ASGI middleware; FastAPI's @app.middleware("http") would hide a client's disconnect from
    the routes, which need to see it to abort the request.
    """

    def __init__(self, app: Any, key: str, open_routes: tuple[str, ...] = ("/health",)) -> None:
        self.app, self.key, self.open_routes = app, key.encode(), open_routes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if scope["type"] == "http" and not path.rstrip("/").endswith(self.open_routes):
            given = _given_key(dict(scope["headers"]))
            if not given:
                refused: WorkerError = MissingApiKey(NO_KEY_ANTHROPIC if is_messages_route(path) else NO_KEY)
            elif not secrets.compare_digest(given.encode("latin-1"), self.key):
                refused = AuthenticationFailed("Incorrect API key provided.")
            else:
                await self.app(scope, receive, send)
                return
            await error_response(refused, path=path)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _given_key(headers: dict[bytes, bytes]) -> str:
    """The key a request carries: `Authorization: Bearer <key>` (a bare `Bearer` is none), else `x-api-key`."""
    scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").strip().partition(" ")
    given = token.strip() if scheme.lower() == "bearer" else scheme
    return given or headers.get(b"x-api-key", b"").decode("latin-1").strip()
