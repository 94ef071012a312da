"""Qwen3.5's XML tool calls end to end: the default model served with the Qwen3.5 template as the request's own
(`chat_template`), through the official openai client. The template's tools section reaches the prompt, and forced
calls ("required", a named tool) come out as typed arguments that validate against the schema, whole and streamed
alike, whatever the model (which never saw this format) would write unconstrained."""

from __future__ import annotations

import json

import jsonschema
import pytest
from family_templates import QWEN35
from openai_schema import validate

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city for a few days.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "hourly": {"type": "boolean"},
            },
            "required": ["city", "days"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["tz"],
        },
    },
}
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]
# Thinking off: the template closes an empty <think>, so the answer starts at the call.
QWEN35_BODY = {"chat_template": QWEN35, "chat_template_kwargs": {"enable_thinking": False}}


def _calls(message) -> list[tuple[str, dict]]:
    out = []
    for call in message.tool_calls or []:
        assert call.id.startswith("call_") and call.type == "function"
        arguments = json.loads(call.function.arguments)
        schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
        jsonschema.validate(arguments, schema)
        out.append((call.function.name, arguments))
    return out


def test_the_prompt_shows_the_tools_and_the_xml_call_format(client, model_name, tokenizer) -> None:
    response = client.chat.completions.create(
        model=model_name,
        messages=ASK,
        tools=[WEATHER],
        max_tokens=1,
        extra_body={**QWEN35_BODY, "return_token_ids": True},
    )
    prompt = tokenizer.decode(response.model_extra["prompt_token_ids"])
    assert prompt.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>")
    assert '"name": "get_weather"' in prompt and "<function=example_function_name>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize(
    "choice,name", [("required", "get_weather"), ({"type": "function", "function": {"name": "get_time"}}, "get_time")]
)
def test_forced_calls_are_typed_and_valid_whole_and_streamed(client, model_name, choice, name) -> None:
    kw = dict(
        model=model_name,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice=choice,
        max_tokens=96,
        temperature=0,
        parallel_tool_calls=False,
        extra_body=QWEN35_BODY,
    )
    whole = client.chat.completions.create(**kw)
    validate(whole)
    choice0 = whole.choices[0]
    calls = _calls(choice0.message)
    assert [n for n, _ in calls] == [name] and choice0.finish_reason == "tool_calls", choice0
    assert choice0.message.content is None
    if name == "get_weather":
        assert isinstance(calls[0][1]["days"], int)  # typed by the schema, not the XML's text
    # Streamed: the call opens with its id and name, then its arguments in fragments that join into the whole's.
    chunks = list(client.chat.completions.create(stream=True, **kw))
    for chunk in chunks:
        validate(chunk)
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == name
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == choice0.message.tool_calls[0].function.arguments
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
