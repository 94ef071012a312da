"""Forced parallel tool calls on the default model end: greedy, SmolLM2 repeats its call (issue 29: nine
calls and "length" at max_tokens 400, and no end at all without max_tokens). A call identical to an earlier
one of the same answer ends the answer without it, with finish_reason "tool_calls", on the chat route (each
choice on its own, whole and streamed), the Responses API and native jobs, through the official client."""

from __future__ import annotations

import json

import pytest
from openai_schema import validate

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# Room for the two calls and the repeat that ends them (about 40 tokens each); the loop used all of it before.
BUDGET = 160
# The tools' grammar compiles on the first request; on a busy 2-core CI machine that and a few hundred tokens
# take minutes, past the client's usual limit.
SLOW_S = 600


@pytest.fixture(scope="module")
def patient(client):
    return client.with_options(timeout=SLOW_S)


def _distinct(calls: list[tuple[str, str]]) -> list[tuple[str, object]]:
    """The calls as (name, arguments object); no two of them alike."""
    parsed = [(name, json.loads(arguments)) for name, arguments in calls]
    assert parsed and all(a != b for i, a in enumerate(parsed) for b in parsed[i + 1 :]), parsed
    return parsed


@pytest.fixture(scope="module")
def answered(patient, model_name):
    response = patient.chat.completions.create(
        model=model_name, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=BUDGET, n=2
    )
    validate(response)
    return response


def test_a_repeated_forced_call_ends_each_choice_with_tool_calls(answered) -> None:
    answers = []
    for choice in answered.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        answers.append(_distinct([(c.function.name, c.function.arguments) for c in choice.message.tool_calls]))
    assert answers[0] == answers[1]  # greedy: each choice read on its own, to the same end
    assert answered.usage.completion_tokens < 2 * BUDGET


def test_streamed_the_repeat_never_reaches_a_delta(patient, model_name, answered) -> None:
    with patient.chat.completions.stream(
        model=model_name, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=BUDGET
    ) as stream:
        indexes = {
            d.index for e in stream if e.type == "chunk" for c in e.chunk.choices for d in c.delta.tool_calls or []
        }
        final = stream.get_final_completion().choices[0]
    expected = [(c.function.name, c.function.arguments) for c in answered.choices[0].message.tool_calls]
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == expected
    assert indexes == set(range(len(expected))) and final.finish_reason == "tool_calls"


def test_the_responses_api_completes(patient, model_name) -> None:
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    made = patient.responses.create(
        model=model_name,
        input=ASK[0]["content"],
        tools=tools,
        tool_choice="required",
        temperature=0,
        max_output_tokens=BUDGET,
    )
    validate(made)
    assert made.status == "completed" and made.incomplete_details is None
    _distinct([(item.name, item.arguments) for item in made.output if item.type == "function_call"])
    assert made.usage.output_tokens < BUDGET


def test_a_native_job_ends_at_the_repeat(http) -> None:
    job = {
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "required",
        "sampling_params": {"temperature": 0, "max_tokens": BUDGET},
    }
    done = http.post("/runsync", json={"input": job}, timeout=SLOW_S).json()
    assert done["status"] == "COMPLETED", done
    [output] = done["output"]
    _distinct([(c["function"]["name"], c["function"]["arguments"]) for c in output["choices"][0]["tool_calls"]])
    assert output["usage"]["output"] < BUDGET
