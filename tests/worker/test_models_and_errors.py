"""/v1/models, and every error: a clean OpenAI error object with the right status, then service goes on."""

from __future__ import annotations

import openai
import pytest
from openai_schema import validate

Q = [{"role": "user", "content": "Hi"}]


def test_models_list_and_retrieve(client, model_name) -> None:
    models = client.models.list()
    validate(models.model_dump(exclude_unset=True))
    assert [m.id for m in models.data] == [model_name]
    card = client.models.retrieve(model_name)
    validate(card.model_dump(exclude_unset=True))
    assert card.id == model_name and card.object == "model" and card.model_extra["max_model_len"] == 2048
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert validate(info.value.response.json())["error"]["code"] == "model_not_found"


def _served(client, model_name) -> None:
    """The worker still answers a normal request."""
    response = client.chat.completions.create(model=model_name, messages=Q, max_tokens=2, temperature=0)
    assert response.choices[0].message.content is not None


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    return validate(response.json())["error"]


def test_wrong_and_missing_model(client, http, model_name) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=Q)
    assert info.value.code == "model_not_found" and info.value.param == "model"
    error = _error(http.post("/openai/v1/completions", json={"prompt": "x"}), 400)
    assert error["param"] == "model" and error["type"] == "invalid_request_error"
    _served(client, model_name)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"temperature": 3}, "temperature"),
        ({"temperature": "warm"}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"messages": "not a list"}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages.[0].role"),
        ({"logit_bias": {"99999999": 5}}, "logit_bias"),
        ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"extra_body": {"chat_template": "{% if %}"}}, "chat_template"),
        ({"extra_body": {"top_k": -2}}, "top_k"),
        ({"extra_body": {"continue_final_message": True}}, "continue_final_message"),
    ],
)
def test_bad_parameters_are_400_naming_the_param(client, model_name, body, param) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, **{"messages": Q, **body})
    error = validate(info.value.response.json())["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_invalid_json_and_non_object_bodies(http, client, model_name) -> None:
    error = _error(
        http.post("/openai/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"}),
        400,
    )
    assert "JSON" in error["message"]
    _error(http.post("/openai/v1/chat/completions", json=[1, 2, 3]), 400)
    _error(http.post("/v2/x/runsync", json={"no_input": 1}), 400)
    _served(client, model_name)


def test_prompt_over_the_context_and_a_2mb_prompt(client, http, model_name) -> None:
    long_prompt = "hello " * 2100  # over the test worker's 2048-token context
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt=long_prompt, max_tokens=4)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt="hello", max_tokens=4000)
    assert info.value.code == "context_length_exceeded" and info.value.param == "max_tokens"
    huge = "hello world " * (2 * 1024 * 1024 // 12)  # 2 MB of text
    error = _error(
        http.post(
            "/openai/v1/chat/completions",
            json={"model": model_name, "messages": [{"role": "user", "content": huge}], "stream": True},
        ),
        400,
    )
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"  # as the chat route calls it
    _served(client, model_name)


def test_unknown_routes(http, client, model_name) -> None:
    error = _error(http.post("/openai/v1/audio/speech", json={"model": model_name, "input": "x"}), 404)
    assert error["code"] == "unknown_url"
    job = http.post("/v2/x/runsync", json={"input": {"openai_route": "/v1/audio/speech", "openai_input": {}}}).json()
    assert job["status"] == "FAILED" and job["error"]["code"] == "unknown_url"
    assert http.get("/v2/x/status/no-such-job").status_code == 404
    # Paths outside every router and wrong methods answer OpenAI error objects too, not FastAPI's {"detail"}.
    for path in ("/nothing/here", "/v1/chat/completions", "/v2/x/openai/v2/models"):
        assert _error(http.post(path, json={}), 404)["code"] == "unknown_url"
    assert _error(http.get("/v2/x/runsync"), 405)["code"] == "method_not_allowed"
    _served(client, model_name)


def test_api_key_guards_everything_but_health(custom_worker) -> None:
    import httpx

    assert httpx.get(custom_worker.url("/health")).status_code == 200
    for path in ("/openai/v1/models", "/v2/e/openai/v1/models", "/v2/e/status/x"):
        response = httpx.get(custom_worker.url(path), headers={"Authorization": "Bearer wrong"})
        error = _error(response, 401)
        assert error["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=custom_worker.openai_url, api_key="wrong", max_retries=0).models.list()
    assert custom_worker.client().models.list().data[0].id == "custom-name"


def test_a_request_with_no_key_is_told_so_in_openais_words(custom_worker) -> None:
    import httpx

    with pytest.raises(openai.AuthenticationError) as info:  # the SDK needs a key: its header is left out
        custom_worker.client().models.list(extra_headers={"Authorization": openai.Omit()})
    assert info.value.status_code == 401
    error = validate(info.value.response.json())["error"]
    assert error["message"].startswith("You didn't provide an API key.") and error["type"] == "invalid_request_error"
    assert error["code"] is None and error["param"] is None
    bare = _error(httpx.get(custom_worker.url("/openai/v1/models"), headers={"Authorization": "Bearer"}), 401)
    assert bare["message"].startswith("You didn't provide an API key.")
    # A wrong key keeps its own message; Anthropic's clients hear Anthropic's words for a missing one.
    wrong = _error(httpx.get(custom_worker.url("/openai/v1/models"), headers={"Authorization": "Bearer no"}), 401)
    assert wrong["message"] == "Incorrect API key provided." and wrong["code"] == "invalid_api_key"
    anthropic = httpx.post(custom_worker.url("/openai/v1/messages"), json={})
    assert anthropic.status_code == 401 and anthropic.json()["error"] == {
        "type": "authentication_error",
        "message": "x-api-key header is required",
    }
