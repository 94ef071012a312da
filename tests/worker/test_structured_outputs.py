"""Structured outputs through the OpenAI doors (official client) and native jobs: response_format, vLLM's
structured_outputs / guided_* names, SGLang's regex / ebnf / json_schema; bad constraints are 400s that
name the parameter, before any token, and the worker goes on serving."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from openai_schema import validate
from pydantic import BaseModel, Field

from tests.structured_schemas import SCHEMAS

FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER


def ask(schema: dict) -> list[dict]:
    return [{"role": "user", "content": f"Reply in JSON that follows this schema: {json.dumps(schema)}"}]


def chat(client: openai.OpenAI, model: str, messages: list[dict], **kw):
    kw.setdefault("max_tokens", 150)
    kw.setdefault("temperature", 0)
    response = client.chat.completions.create(model=model, messages=messages, **kw)
    validate(response)
    return response


def test_response_format_json_schema(client, model_name) -> None:
    names = ["flat_object", "nested_objects", "ref_defs", "array_of_objects", "formats", "string_pattern"]

    def one(name: str):
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
        return chat(client, model_name, ask(SCHEMAS[name]), response_format=fmt)

    with ThreadPoolExecutor(len(names)) as pool:  # together, as the engine batches them
        responses = list(pool.map(one, names))
    for name, response in zip(names, responses, strict=True):
        choice = response.choices[0]
        assert choice.finish_reason == "stop", (name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name], format_checker=FORMATS)


def test_the_sdk_parse_helper_and_json_object(client, model_name) -> None:
    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)
        population: int = Field(ge=0, le=100_000_000)  # a small model would write digits forever

    parsed = client.chat.completions.parse(
        model=model_name,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        temperature=0,
        max_tokens=80,
    )
    assert isinstance(parsed.choices[0].message.parsed, City)
    anything = chat(
        client,
        model_name,
        [{"role": "user", "content": "Describe a cat as a JSON object with a name and an age."}],
        response_format={"type": "json_object"},
    )
    assert anything.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(anything.choices[0].message.content), dict)


def test_vllm_and_sglang_names_on_completions(client, model_name) -> None:
    prompt = "Q: Is the sky blue?\nA:"
    cases = [
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"structured_outputs": {"choice": ["alpha", "beta gamma"]}}, lambda t: t in ("alpha", "beta gamma")),
        ({"guided_regex": r"[0-9]{3}-[a-z]{3}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{3}", t)),
        ({"structured_outputs": {"regex": r"(true|false)\."}}, lambda t: t in ("true.", "false.")),
        ({"regex": r"[A-Z][a-z]{2,6}"}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,6}", t)),
        ({"ebnf": 'root ::= "answer: " ("yes" | "no")'}, lambda t: t in ("answer: yes", "answer: no")),
        (
            {"structured_outputs": {"grammar": 'root ::= [0-9] [0-9]? " apples"'}},
            lambda t: re.fullmatch(r"[0-9][0-9]? apples", t),
        ),
        (
            {"guided_json": SCHEMAS["flat_object"]},
            lambda t: jsonschema.validate(json.loads(t), SCHEMAS["flat_object"]) is None,
        ),
        (
            {"structured_outputs": {"json": json.dumps(SCHEMAS["booleans_and_null"]), "disable_any_whitespace": True}},
            lambda t: jsonschema.validate(json.loads(t), SCHEMAS["booleans_and_null"]) is None and "\n" not in t,
        ),
        ({"json_schema": json.dumps(SCHEMAS["string_enum"])}, lambda t: t in ('"red"', '"green"', '"blue"')),
        (
            {"structured_outputs": {"json_object": True}, "guided_decoding_backend": "xgrammar"},
            lambda t: isinstance(json.loads(t), dict),
        ),
    ]

    def one(body: dict):
        return client.completions.create(model=model_name, prompt=prompt, max_tokens=60, temperature=0, extra_body=body)

    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(one, [body for body, _ in cases]))
    for (body, check), response in zip(cases, responses, strict=True):
        validate(response)
        choice = response.choices[0]
        assert choice.finish_reason == "stop" and check(choice.text), (body, choice.text)


def test_streamed_text_equals_the_whole_answer(client, model_name) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS["nested_objects"]}}
    messages = ask(SCHEMAS["nested_objects"])
    whole = chat(client, model_name, messages, response_format=fmt, n=2, seed=5, temperature=0.8)
    stream = client.chat.completions.create(
        model=model_name,
        messages=messages,
        response_format=fmt,
        n=2,
        seed=5,
        temperature=0.8,
        max_tokens=150,
        stream=True,
    )
    texts, reasons = ["", ""], [None, None]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert texts == [c.message.content for c in whole.choices]
    assert reasons == ["stop", "stop"]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMAS["nested_objects"])


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
            "response_format",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
            "response_format",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}},
            "response_format.json_schema.name",
        ),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "a(b"}, "guided_regex"),
        ({"regex": "[z-a]"}, "regex"),
        ({"ebnf": 'root ::= "a" |'}, "ebnf"),
        ({"json_schema": '{"type": "array", "uniqueItems": true}'}, "json_schema"),
        ({"guided_choice": []}, "guided_choice"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"guided_json": {"type": "object"}, "regex": "a"}, "regex"),
        ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        ({"guided_json": {"type": "object"}, "guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
    ],
)
def test_bad_constraints_are_400s_naming_the_param(client, model_name, body, param) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, extra_body=body
        )
    error = info.value.body
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    # The worker goes on serving, constrained or not.
    ok = client.completions.create(model=model_name, prompt="Hi", max_tokens=5, extra_body={"regex": "[a-z]{3}"})
    assert re.fullmatch("[a-z]{3}", ok.choices[0].text)


def test_native_jobs_take_vllms_names(http) -> None:
    schema = SCHEMAS["flat_object"]
    for params in (
        {"guided_json": schema},
        {"structured_outputs": {"json": schema}},
        {"guided_decoding": {"json": json.dumps(schema)}},
    ):
        job = {"messages": ask(schema), "sampling_params": {"temperature": 0, "max_tokens": 80, **params}}
        result = http.post("/runsync", json={"input": job}).json()
        assert result["status"] == "COMPLETED", result
        [text] = result["output"][0]["choices"][0]["tokens"]
        jsonschema.validate(json.loads(text), schema)
    streamed = http.post(
        "/runsync",
        json={
            "input": {
                "prompt": "Pick:",
                "stream": True,
                "sampling_params": {"temperature": 0, "max_tokens": 10, "guided_choice": ["left", "right"]},
            }
        },
    ).json()
    assert "".join(t for o in streamed["output"] for t in o["choices"][0]["tokens"]) in ("left", "right")
    for params, param in (
        ({"guided_regex": "(("}, "guided_regex"),
        ({"structured": {"kind": "regex"}}, "structured"),
        ({"guided_json": {"type": "object"}, "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"json": {}}, "guided_decoding": {"regex": "a"}}, "guided_decoding"),
    ):
        bad = http.post("/runsync", json={"input": {"prompt": "Hi", "sampling_params": params}}).json()
        assert bad["status"] == "FAILED" and bad["error"]["param"] == param, bad


class City(BaseModel):
    name: str
    country: str
    population: int


def test_a_parsed_response_is_valid_json_within_a_small_budget(client, model_name) -> None:
    # Free whitespace let the default model pad this answer with newlines until max_output_tokens ran out, and the
    # SDK's parse failed (json_invalid); at most 16 whitespace characters in a row, the JSON closes in time.
    parsed = client.responses.parse(
        model=model_name, input="Tell me about Paris.", text_format=City, max_output_tokens=96, temperature=0
    )
    assert isinstance(parsed.output_parsed, City), parsed.output_text
