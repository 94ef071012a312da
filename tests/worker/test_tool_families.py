"""Each family's tiny random-weight model, served in process with a chat template written to its published
format: the right tool-call and reasoning formats are picked, tools and a second turn render through the
template, and forced calls come out valid against their schemas whatever the random weights prefer."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
from family_templates import QWEN3_THINKING
from openai_schema import validate
from tiny_families import FAMILIES, build_family, serve

from worker.openai.chat import complete_chat, prepare_chat, stream_chat

EXPECTED = {
    "qwen2": ("hermes", None),
    "qwen3": ("hermes", "qwen3"),
    "llama": ("llama3_json", None),
    "mistral": ("mistral", None),
}
# Bounded values: random weights would otherwise write one string until max_tokens.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
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
SECOND_TURN = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0123456789abcdef01234567",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_0123456789abcdef01234567", "content": "21 C"},
    {"role": "user", "content": "And in Rome?"},
]


@pytest.fixture(scope="module")
def runtimes(baked_model_path, tmp_path_factory):
    """runtimes(family) -> a Runtime serving that family's tiny model (built once per module)."""
    served = {}

    def get(name: str):
        if name not in served:
            served[name] = serve(build_family(name, baked_model_path, tmp_path_factory.mktemp(name)))
        return served[name]

    yield get
    for runtime in served.values():
        runtime.engine.shutdown()


@pytest.fixture(params=sorted(FAMILIES))
def family(request, runtimes):
    return request.param, runtimes(request.param)


def _chat(runtime, **body):
    body.setdefault("model", runtime.served_model_name)
    body.setdefault("temperature", 0)
    call = prepare_chat(body, runtime)
    return call, asyncio.run(complete_chat(call))


def test_the_familys_formats_are_picked_and_a_second_turn_renders(family) -> None:
    name, runtime = family
    assert (runtime.tool_format, runtime.reasoning_format) == EXPECTED[name]
    call, answer = _chat(runtime, messages=SECOND_TURN, tools=[WEATHER], max_tokens=4)
    assert '"get_weather"' in call.prompt.text and "21 C" in call.prompt.text
    message = answer["choices"][0]["message"]
    assert isinstance(message["content"], str) or message.get("tool_calls")


def _stream(runtime, **body):
    body.setdefault("model", runtime.served_model_name)
    body.setdefault("temperature", 0)
    call = prepare_chat({**body, "stream": True, "stream_options": {"include_usage": True}}, runtime)

    async def run():
        return [chunk async for chunk in stream_chat(call)]

    return asyncio.run(run())


def test_reasoning_opened_by_the_template_is_split_off_whole_and_streamed(runtimes) -> None:
    runtime = runtimes("qwen3")
    body = {
        "messages": [{"role": "user", "content": "Think."}],
        "max_tokens": 6,
        "ignore_eos": True,
        "chat_template": QWEN3_THINKING,
    }
    _, answer = _chat(runtime, **body)
    validate(answer)
    message, usage = answer["choices"][0]["message"], answer["usage"]
    # The template opened <think> and the random model never closes it: everything is reasoning.
    assert message["reasoning_content"] == message["reasoning"] and message["reasoning_content"]
    assert message["content"] == "" and answer["choices"][0]["finish_reason"] == "length"
    assert usage["completion_tokens_details"]["reasoning_tokens"] == usage["completion_tokens"] == 6
    chunks = [validate(c) for c in _stream(runtime, **body)]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == ""
    assert chunks[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] == 6
    _, inline = _chat(runtime, **body, separate_reasoning=False)
    assert inline["choices"][0]["message"]["content"] == message["reasoning_content"]
    assert inline["choices"][0]["message"]["reasoning_content"] is None


def _calls_of(message) -> list[tuple[str, dict]]:
    out = []
    for call in message.get("tool_calls") or []:
        assert call["id"].startswith("call_") and call["type"] == "function"
        arguments = json.loads(call["function"]["arguments"])
        jsonschema.validate(arguments, WEATHER["function"]["parameters"])
        out.append((call["function"]["name"], arguments))
    return out


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_calls_from_random_weights_are_valid_whole_and_streamed(family, choice) -> None:
    name, runtime = family
    body = {
        "messages": SECOND_TURN,
        "tools": [WEATHER],
        "tool_choice": choice,
        "max_tokens": 96,
        "parallel_tool_calls": False,
    }
    call, answer = _chat(runtime, **body)
    validate(answer)
    choice0 = answer["choices"][0]
    calls = _calls_of(choice0["message"])
    assert [n for n, _ in calls] == ["get_weather"] and choice0["finish_reason"] == "tool_calls", choice0
    assert choice0["message"]["content"] is None
    # Streamed, the deltas join into the same call.
    chunks = [validate(c) for c in _stream(runtime, **body)]
    deltas = [d for c in chunks if c["choices"] for d in c["choices"][0]["delta"].get("tool_calls") or []]
    assert deltas[0]["function"]["name"] == "get_weather" and deltas[0]["id"].startswith("call_")
    assert (
        "".join(d["function"]["arguments"] for d in deltas)
        == choice0["message"]["tool_calls"][0]["function"]["arguments"]
    )
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks if c["choices"])
