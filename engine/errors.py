"""Typed errors the engine raises; the worker maps them to OpenAI error objects in one place."""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose. Raised as itself, it is the engine's own fault: a
    state it should never reach (HTTP 500, server_error); the subclasses say when the cause lies elsewhere."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(EngineError):
    """A request parameter is out of range or inconsistent (HTTP 400, invalid_request_error)."""


class ContextTooLong(EngineError):
    """The prompt, or prompt + max_tokens, does not fit in max_model_len (HTTP 400, context_length_exceeded)."""


class ShuttingDown(EngineError):
    """The worker is stopping and its grace period is over: running requests end with this (HTTP 503)."""


class UnsupportedModel(EngineError):
    """The checkpoint's architecture or layout is one the engine cannot run."""


class StartupError(EngineError):
    """The engine cannot start as configured; the message names the setting to change."""


class RankFailed(EngineError):
    """A tensor-parallel rank died or stopped answering: the engine cannot go on (the worker exits)."""


class NoImageInput(InvalidRequest):
    """A request with images for a model that takes none (HTTP 400)."""
