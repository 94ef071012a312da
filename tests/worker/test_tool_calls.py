"""Tool calling end to end on the default model (SmolLM2, whose ChatML template knows no tools: the generic
format), through the official openai client, its stream helper, raw HTTP and native jobs: the prompt the
tools and a second turn make, forced calls ("required", a named tool, one call only) whose arguments validate
against their schemas, streamed calls that join into the whole answer's, and malformed tools as 400s."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai_schema import validate

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SECOND_TURN = ASK + [
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_abc123abc123abc123abc123",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_abc123abc123abc123abc123", "content": '{"celsius": 21, "sky": "clear"}'},
]


def _prompt(client, model_name, tokenizer, **kw) -> str:
    kw.setdefault("messages", ASK)
    response = client.chat.completions.create(
        model=model_name, max_tokens=1, temperature=0, extra_body={"return_token_ids": True}, **kw
    )
    validate(response)
    return tokenizer.decode(response.model_extra["prompt_token_ids"])


def test_tools_are_described_in_the_system_prompt_and_a_second_turn_renders(client, model_name, tokenizer) -> None:
    plain = _prompt(client, model_name, tokenizer)
    offered = _prompt(client, model_name, tokenizer, tools=[WEATHER])
    assert "get_weather" not in plain and '"name": "get_weather"' in offered and "<tool_call>" in offered
    assert _prompt(client, model_name, tokenizer, tools=[WEATHER], tool_choice="none") == plain
    second = _prompt(client, model_name, tokenizer, messages=SECOND_TURN, tools=[WEATHER])
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in second
    assert '<|im_start|>user\nThe function get_weather returned:\n{"celsius": 21, "sky": "clear"}' in second
    one = _prompt(client, model_name, tokenizer, tools=[WEATHER], parallel_tool_calls=False)
    assert "at most one function" in one


def test_an_answer_with_tools_streams_as_it_answers_whole(client, model_name) -> None:
    kw = dict(model=model_name, messages=SECOND_TURN, tools=[WEATHER], max_tokens=12, temperature=0)
    whole = validate(client.chat.completions.create(**kw))
    chunks = [
        validate(c) for c in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    ]
    message = whole["choices"][0]["message"]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert content == (message["content"] or "")
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == whole["choices"][0]["finish_reason"]
    assert chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]


@pytest.mark.parametrize(
    "tools,choice,param",
    [
        ([{"type": "function", "function": {"description": "nameless"}}], None, "tools[0].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
            None,
            "tools[0].function.parameters",
        ),
        ([WEATHER, WEATHER], None, "tools[1].function.name"),
        ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, "tool_choice"),
    ],
)
def test_malformed_tools_are_400s_naming_the_parameter(client, model_name, tools, choice, param) -> None:
    kw = {"tool_choice": choice} if choice is not None else {}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=ASK, tools=tools, max_tokens=2, **kw)
    assert info.value.status_code == 400 and info.value.body["param"] == param


def test_native_jobs_take_tools_with_messages(http) -> None:
    job = {"messages": SECOND_TURN, "tools": [WEATHER], "sampling_params": {"temperature": 0, "max_tokens": 8}}
    whole = http.post("/runsync", json={"input": job}).json()
    assert whole["status"] == "COMPLETED", whole
    [choice] = whole["output"][0]["choices"]
    assert choice["tool_calls"] == [] and isinstance(choice["tokens"][0], str)
    streamed = http.post("/runsync", json={"input": {**job, "stream": True}}).json()
    pieces = [t for out in streamed["output"] for t in out["choices"][0]["tokens"]]
    assert "".join(pieces) == choice["tokens"][0]
    bad = http.post("/runsync", json={"input": {**job, "tools": [{"type": "function", "function": {}}]}}).json()
    assert bad["status"] == "FAILED" and bad["error"]["param"] == "tools[0].function.name"
    no_messages = http.post("/runsync", json={"input": {"prompt": "Hi", "tools": [WEATHER]}}).json()
    assert no_messages["status"] == "FAILED" and no_messages["error"]["param"] == "tools"


TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a timezone.",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "enum": ["UTC", "CET", "JST"]}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def _calls(client, model_name, **kw):
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 64)
    response = client.chat.completions.create(model=model_name, temperature=0, **kw)
    validate(response)
    return response


def _assert_valid(message) -> list[tuple[str, dict]]:
    assert message.tool_calls and message.content is None
    out = []
    for call in message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def test_required_with_several_tools_gives_one_valid_call_when_parallel_calls_are_off(client, model_name) -> None:
    response = _calls(client, model_name, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert response.choices[0].finish_reason == "tool_calls"
    [(name, _)] = _assert_valid(response.choices[0].message)
    assert name in ("get_weather", "get_time")


def test_required_with_parallel_calls_gives_calls_that_each_validate(client, model_name) -> None:
    # Greedy, the small model would repeat its call until max_tokens; the repeat ends the answer instead
    # (tests/worker/test_tool_call_repeats.py). Every call written out in full validates.
    response = _calls(client, model_name, tools=[WEATHER, TIME], tool_choice="required")
    choice = response.choices[0]
    assert choice.message.content is None and choice.finish_reason in ("tool_calls", "length")
    calls = choice.message.tool_calls
    for i, call in enumerate(calls):
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:  # cut by max_tokens
            assert i == len(calls) - 1 and choice.finish_reason == "length"
            continue
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
    assert calls and json.loads(calls[0].function.arguments)
    assert len({(c.function.name, c.function.arguments) for c in calls}) == len(calls)


def test_a_named_tool_is_the_one_call(client, model_name) -> None:
    response = _calls(
        client, model_name, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}
    )
    calls = _assert_valid(response.choices[0].message)
    assert [name for name, _ in calls] == ["get_time"] and calls[0][1]["timezone"] in ("UTC", "CET", "JST")
    assert response.choices[0].finish_reason == "tool_calls"


def test_the_sdk_stream_helper_joins_the_same_calls_as_the_whole_answer(client, model_name) -> None:
    kw = dict(
        model=model_name,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        temperature=0,
        max_tokens=64,
        parallel_tool_calls=False,
    )
    whole = client.chat.completions.create(**kw)
    with client.chat.completions.stream(**kw) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        final = stream.get_final_completion()
    expected = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    got = final.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in got] == expected
    assert final.choices[0].finish_reason == "tool_calls" and not final.choices[0].message.content
    for call in got:  # the strict tool's arguments come back parsed
        if call.function.name == "get_time":
            assert call.function.parsed_arguments == json.loads(call.function.arguments)
    for chunk in chunks:
        validate(chunk)
        for choice in chunk.choices:
            for delta_call in choice.delta.tool_calls or []:
                assert (delta_call.id is None) == (delta_call.function.name is None)


def test_an_agent_loop_round_trip(client, model_name) -> None:
    first = _calls(client, model_name, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    message = first.choices[0].message
    call = message.tool_calls[0]
    history = ASK + [
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'},
    ]
    second = _calls(client, model_name, messages=history, tools=[WEATHER], max_tokens=16)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_native_job_forced_to_call(http) -> None:
    job = {
        "messages": ASK,
        "tools": [WEATHER, TIME],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "sampling_params": {"temperature": 0, "max_tokens": 64},
    }
    whole = http.post("/runsync", json={"input": job}).json()
    assert whole["status"] == "COMPLETED", whole
    [choice] = whole["output"][0]["choices"]
    [call] = choice["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS["get_weather"])
    streamed = http.post("/runsync", json={"input": {**job, "stream": True}}).json()
    deltas = [d for out in streamed["output"] for d in out["choices"][0].get("tool_calls", [])]
    assert deltas[0]["function"]["name"] == "get_weather"
    assert "".join(d["function"].get("arguments", "") for d in deltas) == call["function"]["arguments"]


@pytest.mark.parametrize(
    "choice, max_tokens",
    [
        ("required", 6),  # cut just after the opener "<tool_call>\n"
        ({"type": "function", "function": {"name": "get_weather"}}, 3),  # cut inside it: "<tool_"
    ],
)
def test_a_forced_call_cut_by_max_tokens_shows_no_markup(client, model_name, choice, max_tokens) -> None:
    kw = dict(model=model_name, messages=ASK, tools=[WEATHER], tool_choice=choice, temperature=0, max_tokens=max_tokens)
    response = client.chat.completions.create(**kw)
    validate(response)
    whole = response.choices[0]
    assert whole.finish_reason == "length"
    assert not whole.message.content and not whole.message.tool_calls, whole.message
    # (the SDK's stream helper refuses an answer cut by the length limit: the chunks are read as they come)
    chunks = [chunk for chunk in client.chat.completions.create(stream=True, **kw) if chunk.choices]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    assert not [call for c in chunks for call in c.choices[0].delta.tool_calls or []]
