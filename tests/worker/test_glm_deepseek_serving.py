"""GLM's, DeepSeek V3.1's, Seed-OSS's and Granite's tool calls end to end: the default model served with each family's
template as the request's own (`chat_template`), through the official openai client. Forced calls ("required", a
named tool) come out in the family's markup, held to it by the grammar, and are read back as calls whose arguments
validate against the schema, whole and streamed alike, whatever the model (which never saw these formats) would
write unconstrained."""

from __future__ import annotations

import json

import jsonschema
import pytest
from family_templates import DEEPSEEK_V31, GLM45, GRANITE30, SEED_OSS
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
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]
# Thinking off: both templates close the reasoning in the prompt, so the answer starts at the call.
BODIES = {
    "glm45": {"chat_template": GLM45, "chat_template_kwargs": {"enable_thinking": False}},
    "deepseek_v31": {"chat_template": DEEPSEEK_V31},
    "seed_oss": {"chat_template": SEED_OSS},
    "granite": {"chat_template": GRANITE30},
}


@pytest.mark.parametrize("family", sorted(BODIES))
@pytest.mark.parametrize(
    "choice,name", [("required", None), ({"type": "function", "function": {"name": "get_time"}}, "get_time")]
)
def test_forced_calls_are_valid_whole_and_streamed(client, model_name, family, choice, name: str | None) -> None:
    kw = dict(
        model=model_name,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice=choice,
        max_tokens=160,
        temperature=0,
        parallel_tool_calls=False,
        extra_body=BODIES[family],
    )
    whole = client.chat.completions.create(**kw)
    validate(whole)
    choice0 = whole.choices[0]
    assert choice0.finish_reason == "tool_calls" and choice0.message.content is None, choice0
    calls = choice0.message.tool_calls or []
    assert len(calls) == 1 and calls[0].id.startswith("call_")
    name = name or calls[0].function.name  # "required": the model picks the tool
    assert calls[0].function.name == name
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS[name])
    chunks = list(client.chat.completions.create(stream=True, **kw))
    for chunk in chunks:
        validate(chunk)
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == name
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == calls[0].function.arguments
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
