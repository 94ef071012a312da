"""Request models and the mapping to SamplingParams, without an engine."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from engine.errors import InvalidRequest
from worker.openai.errors import BadRequest, error_body
from worker.openai.params import DEFAULT_TEMPERATURE, native_sampling_params, openai_sampling_params
from worker.openai.protocol import ChatCompletionRequest, CompletionRequest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _error(body: dict, cls=ChatCompletionRequest) -> dict:
    with pytest.raises((ValidationError, BadRequest)) as info:
        openai_sampling_params(cls.model_validate(body), 2048)
    return error_body(info.value)["error"]


def test_unknown_fields_are_accepted_and_defaults_follow_the_api() -> None:
    chat = ChatCompletionRequest.model_validate({**CHAT, "langchain_extra": {"x": 1}, "tool_choice": "none"})
    params = openai_sampling_params(chat, 2048)
    assert params.max_tokens is None  # chat runs to the end of the context
    assert params.temperature == DEFAULT_TEMPERATURE and params.n == 1
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "hi"})
    assert openai_sampling_params(completion, 2048).max_tokens == 16


def test_every_parameter_reaches_sampling_params() -> None:
    chat = ChatCompletionRequest.model_validate(
        {
            **CHAT,
            "n": 2,
            "best_of": 3,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 5,
            "min_p": 0.1,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "repetition_penalty": 1.2,
            "logit_bias": {"7": -5},
            "seed": 11,
            "stop": "END",
            "max_tokens": 30,
            "max_completion_tokens": 20,
            "logprobs": True,
            "top_logprobs": 3,
            "ignore_eos": True,
            "min_tokens": 2,
            "stop_token_ids": [9],
            "include_stop_str_in_output": True,
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
            "truncate_prompt_tokens": -1,
            "allowed_token_ids": [1, 2, 9],
            "prompt_logprobs": 1,
            "bad_words": ["x"],
        }
    )
    p = openai_sampling_params(chat, 2048)
    assert (p.n, p.best_of, p.temperature, p.top_p, p.top_k, p.min_p) == (2, 3, 0.5, 0.9, 5, 0.1)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert p.logit_bias == {7: -5.0} and p.seed == 11 and p.stop == ["END"]
    assert p.max_tokens == 20  # max_completion_tokens wins over the deprecated max_tokens
    assert p.logprobs == 3 and p.prompt_logprobs == 1 and p.ignore_eos and p.min_tokens == 2
    assert p.stop_token_ids == [9] and p.include_stop_str_in_output
    assert not p.skip_special_tokens and not p.spaces_between_special_tokens
    assert p.truncate_prompt_tokens == 2048 and p.allowed_token_ids == [1, 2, 9] and p.bad_words == ["x"]
    beam = openai_sampling_params(
        ChatCompletionRequest.model_validate(
            {**CHAT, "n": 2, "use_beam_search": True, "temperature": 0, "length_penalty": 0.5, "early_stopping": True}
        ),
        2048,
    )
    assert beam.use_beam_search and beam.length_penalty == 0.5 and beam.early_stopping


def test_beam_search_without_a_temperature_runs_at_zero() -> None:
    beam = openai_sampling_params(ChatCompletionRequest.model_validate({**CHAT, "n": 2, "use_beam_search": True}), 2048)
    assert beam.use_beam_search and beam.temperature == 0.0
    with pytest.raises(InvalidRequest, match="temperature"):  # an explicit temperature is still checked
        openai_sampling_params(
            ChatCompletionRequest.model_validate({**CHAT, "n": 2, "use_beam_search": True, "temperature": 0.7}), 2048
        )


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("choice", ["auto", "none", None])
def test_tools_with_a_free_tool_choice_are_accepted(choice) -> None:
    request = ChatCompletionRequest.model_validate({**CHAT, "tools": [TOOL], "tool_choice": choice})
    assert request.tools == [TOOL]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_call_is_accepted_but_not_of_an_absent_tool(choice) -> None:
    assert ChatCompletionRequest.model_validate({**CHAT, "tools": [TOOL], "tool_choice": choice}).tool_choice == choice
    error = _error({**CHAT, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "absent"}}})
    assert error["param"] == "tool_choice" and error["type"] == "invalid_request_error"


def test_completions_echo_with_logprobs_asks_for_prompt_logprobs() -> None:
    request = CompletionRequest.model_validate({"model": "m", "prompt": [1, 2, 3], "echo": True, "logprobs": 2})
    assert openai_sampling_params(request, 2048).prompt_logprobs == 2


@pytest.mark.parametrize(
    "field, value, param",
    [
        ("temperature", 2.5, "temperature"),
        ("temperature", "hot", "temperature"),
        ("top_p", 0, "top_p"),
        ("n", 0, "n"),
        ("max_tokens", 0, "max_tokens"),
        ("presence_penalty", 3, "presence_penalty"),
        ("top_logprobs", 21, "top_logprobs"),
        ("logit_bias", {"5": 101}, "logit_bias.5"),
        ("logit_bias", {"word": 1}, "logit_bias"),
        ("best_of", 1, "best_of"),
        ("messages", [], "messages"),
        ("messages", "hi", "messages"),
        ("stop", 5, "stop"),
        ("response_format", {"type": "xml"}, "response_format.type"),
        ("min_tokens", -1, "min_tokens"),
        ("top_logprobs", 2, "top_logprobs"),
    ],
)
def test_out_of_range_and_wrong_types_name_the_param(field: str, value: object, param: str) -> None:
    body = {**CHAT, field: value}
    if field == "best_of":
        body["n"] = 2
    error = _error(body)
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_missing_model_is_a_400_naming_model() -> None:
    error = _error({"messages": CHAT["messages"]})
    assert error["param"] == "model" and "model" in error["message"]


def test_completion_prompt_forms_and_rejections() -> None:
    for prompt in ("text", ["a", "b"], [1, 2], [[1, 2], [3]]):
        CompletionRequest.model_validate({"model": "m", "prompt": prompt})
    assert _error({"model": "m", "prompt": {"x": 1}}, CompletionRequest)["param"] == "prompt"
    assert _error({"model": "m", "prompt": []}, CompletionRequest)["param"] == "prompt"
    assert _error({"model": "m", "prompt": "x", "suffix": "y"}, CompletionRequest)["param"] == "suffix"


def test_native_sampling_params_use_vllm_names_and_reject_unknown_ones() -> None:
    p = native_sampling_params({"temperature": 0, "max_tokens": 5, "top_k": -1, "stop": "x"}, 2048)
    assert (p.temperature, p.max_tokens, p.top_k, p.stop) == (0, 5, 0, ["x"])
    assert native_sampling_params(None, 2048).max_tokens == 100
    beam = native_sampling_params({"use_beam_search": True, "best_of": 2}, 2048)
    assert beam.use_beam_search and beam.temperature == 0.0  # as on the OpenAI routes
    with pytest.raises(ValidationError) as info:
        native_sampling_params({"temprature": 0}, 2048)
    assert error_body(info.value)["error"]["param"] == "temprature"
