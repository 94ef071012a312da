"""The one error mapping: typed errors -> OpenAI error objects and statuses."""

from __future__ import annotations

from engine.errors import ContextTooLong, EngineError, InvalidRequest
from worker.openai.errors import AuthenticationFailed, ModelNotFound, RouteNotFound, error_body, status_of


def test_typed_errors_map_to_openai_objects_and_statuses() -> None:
    cases = [
        (InvalidRequest("bad top_p", param="top_p"), 400, "invalid_request_error", "top_p", None),
        (ContextTooLong("too long", param="prompt"), 400, "invalid_request_error", "prompt", "context_length_exceeded"),
        (ModelNotFound("no such model", param="model"), 404, "invalid_request_error", "model", "model_not_found"),
        (RouteNotFound("no such route"), 404, "invalid_request_error", None, "unknown_url"),
        (AuthenticationFailed("wrong key"), 401, "authentication_error", None, "invalid_api_key"),
    ]
    for exc, status, type_, param, code in cases:
        body = error_body(exc)
        assert body == {"error": {"message": exc.message, "type": type_, "param": param, "code": code}}
        assert status_of(body) == status


def test_unexpected_errors_are_500_without_their_details() -> None:
    body = error_body(KeyError("secret internal detail"))
    assert status_of(body) == 500 and body["error"]["type"] == "server_error"
    assert "secret" not in body["error"]["message"] and "Traceback" not in body["error"]["message"]
    assert status_of({"choices": []}) is None


def test_the_engine_own_faults_are_500_server_errors_that_say_what_happened() -> None:
    # e.g. the grammar matcher rejecting a token its own mask allowed: a bug, not a bad request
    body = error_body(EngineError("the grammar rejected token 7, which its own mask allowed"))
    assert status_of(body) == 500 and body["error"]["type"] == "server_error" and body["error"]["param"] is None
    message = "Internal server error: the grammar rejected token 7, which its own mask allowed."
    assert body["error"]["message"] == message
