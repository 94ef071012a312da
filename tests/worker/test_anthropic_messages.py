"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the official `anthropic` client
against the local endpoint, and as RunPod jobs.

Answers are compared with the chat route's answers to the same conversation (temperature 0), never with
hard-coded text; the SDK's `messages.stream` helper checks the event order as it rebuilds the message. Every reply
the SDK reads, and every body the raw requests get, is held to Anthropic's published schema (anthropic_schema.py).
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
from anthropic_client import claude, create, held_to_the_schema, sdk, stream  # noqa: F401 (fixtures, used by name)
from anthropic_schema import check, check_error, check_message, check_stream
from family_templates import QWEN3
from local_worker import ENDPOINT
from openai_schema import parse_events

Q = "What is the capital of France?"
SYSTEM = "Answer in one sentence."
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
CHAT_WEATHER = {
    "type": "function",
    "function": {"name": WEATHER["name"], "description": WEATHER["description"], "parameters": WEATHER["input_schema"]},
}


@pytest.fixture(scope="module")
def first(claude, model_name):
    return create(claude, model_name, system=SYSTEM)


def _chat(client, model, messages, **kw):
    return client.chat.completions.create(model=model, messages=messages, temperature=0, **kw)


def test_a_message_is_the_chat_answer_as_a_text_block(claude, client, model_name, first) -> None:
    assert first.id.startswith("msg_") and first.type == "message" and first.role == "assistant"
    assert first.model == model_name
    [block] = first.content
    assert block.type == "text" and block.text
    chat = _chat(
        client, model_name, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": Q}], max_tokens=24
    )
    assert block.text == chat.choices[0].message.content
    assert first.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    assert first.stop_sequence is None
    assert first.usage.output_tokens == chat.usage.completion_tokens
    counted = claude.messages.count_tokens(model=model_name, system=SYSTEM, messages=[{"role": "user", "content": Q}])
    assert first.usage.input_tokens + first.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_max_tokens_and_stop_sequences_end_the_message_with_their_reason(claude, model_name, first) -> None:
    cut = create(claude, model_name, system=SYSTEM, max_tokens=3)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    assert first.content[0].text.startswith(cut.content[0].text)
    word = first.content[0].text.split()[2]
    stopped = create(claude, model_name, system=SYSTEM, stop_sequences=["unused-sequence", word])
    text = first.content[0].text
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == text[: text.index(word)]


def test_the_stream_helper_rebuilds_the_same_message(claude, model_name, first) -> None:
    with stream(claude, model_name, system=SYSTEM, max_tokens=24, messages=[{"role": "user", "content": Q}]) as s:
        events = list(s)
        final = s.get_final_message()
    kinds = [e.type for e in events if e.type not in ("text",)]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == first.content[0].text
    assert final.content[0].text == first.content[0].text and final.stop_reason == first.stop_reason
    assert final.usage.output_tokens == first.usage.output_tokens


def test_raw_sse_names_every_event_in_anthropics_order(http, model_name) -> None:
    body = {
        "model": model_name,
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "messages": [{"role": "user", "content": Q}],
    }
    with http.stream("POST", "/openai/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"}) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        text = "".join(reply.iter_text())
    assert "[DONE]" not in text
    names = [line.removeprefix("event: ") for line in text.splitlines() if line.startswith("event: ")]
    events = parse_events(text)
    check_stream(events)
    assert names == [e["type"] for e in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[-2]["delta"] == {
        "stop_reason": "max_tokens",
        "stop_sequence": None,
        "stop_details": None,
        "container": None,
    }
    assert events[-2]["usage"]["output_tokens"] == 4


def _calls(message) -> list:
    calls = [block for block in message.content if block.type == "tool_use"]
    for call in calls:
        assert call.id.startswith("toolu_") and call.name == "get_weather"
        jsonschema.validate(call.input, WEATHER["input_schema"])
    return calls


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_forced_tool_use_whole_and_streamed(claude, model_name, choice) -> None:
    ask = {
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER],
        "tool_choice": {**choice, "disable_parallel_tool_use": True},
        "max_tokens": 40,
    }
    made = create(claude, model_name, **ask)
    [call] = _calls(made)
    assert made.stop_reason == "tool_use"
    assert all(block.type != "text" or "<tool_call>" not in block.text for block in made.content)
    with stream(claude, model_name, **ask) as s:
        events = list(s)
        final = s.get_final_message()
    [streamed] = _calls(final)
    fragments = "".join(
        e.delta.partial_json for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    )
    assert json.loads(fragments) == streamed.input == call.input and final.stop_reason == "tool_use"


def test_a_tool_result_goes_back_as_the_chat_routes_tool_turn(claude, client, model_name) -> None:
    question = {"role": "user", "content": "What is the weather in Paris?"}
    made = create(claude, model_name, messages=[question], tools=[WEATHER], tool_choice={"type": "any"}, max_tokens=40)
    [call] = _calls(made)
    result = '{"sky": "sunny", "celsius": 21}'
    answer = create(
        claude,
        model_name,
        tools=[WEATHER],
        tool_choice={"type": "none"},
        max_tokens=20,
        messages=[
            question,
            {"role": "assistant", "content": [block.model_dump() for block in made.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result}]},
        ],
    )
    assert [block.type for block in answer.content] == ["text"] and answer.stop_reason != "tool_use"
    chat = _chat(
        client,
        model_name,
        [
            question,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": json.dumps(call.input)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.id, "content": result},
        ],
        tools=[CHAT_WEATHER],
        tool_choice="none",
        max_tokens=20,
    )
    assert answer.content[0].text == chat.choices[0].message.content
    failed = [
        {"type": "tool_result", "tool_use_id": call.id, "is_error": True, "content": [{"type": "text", "text": result}]}
    ]
    conversation = [question, {"role": "assistant", "content": [block.model_dump() for block in made.content]}]
    plain = claude.messages.count_tokens(
        model=model_name,
        tools=[WEATHER],
        messages=[*conversation, {"role": "user", "content": [{**failed[0], "is_error": False}]}],
    )
    errored = claude.messages.count_tokens(
        model=model_name, tools=[WEATHER], messages=[*conversation, {"role": "user", "content": failed}]
    )
    assert errored.input_tokens > plain.input_tokens  # the error is shown to the model


# The Qwen3 template on the default model; the regex holds the answer to reasoning and then a reply, so the
# blocks come out the same whatever the model prefers.
THOUGHT = "<think>\n[a-z]{2,8}( [a-z]{2,8}){0,3}\n</think>\n\nParis[.]"
THINKS = {"chat_template": QWEN3, "structured_outputs": {"regex": THOUGHT}}


def test_thinking_comes_back_as_a_thinking_block_before_the_text(claude, model_name) -> None:
    ask = {"max_tokens": 60, "thinking": {"type": "enabled", "budget_tokens": 1024}, "extra_body": THINKS}
    made = create(claude, model_name, **ask)
    assert [block.type for block in made.content] == ["thinking", "text"]
    thinking, text = made.content
    assert thinking.thinking and "<think>" not in thinking.thinking and thinking.signature == ""
    assert text.text == "Paris." and made.stop_reason == "end_turn"
    with stream(claude, model_name, messages=[{"role": "user", "content": Q}], **ask) as s:
        events = list(s)
        final = s.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in made.content]
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas[-1] == "text_delta" and "signature_delta" in deltas
    assert deltas.index("signature_delta") < deltas.index("text_delta")
    # The thinking block goes back into the next turn, and disabled thinking closes it in the prompt.
    replay = [
        {"role": "user", "content": Q},
        {"role": "assistant", "content": [b.model_dump() for b in made.content]},
        {"role": "user", "content": "And of Italy?"},
    ]
    assert claude.messages.count_tokens(model=model_name, messages=replay, extra_body={"chat_template": QWEN3})
    on = claude.messages.count_tokens(
        model=model_name,
        messages=[{"role": "user", "content": Q}],
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={"chat_template": QWEN3},
    )
    off = claude.messages.count_tokens(
        model=model_name,
        messages=[{"role": "user", "content": Q}],
        thinking={"type": "disabled"},
        extra_body={"chat_template": QWEN3},
    )
    assert off.input_tokens > on.input_tokens


def test_structured_output_follows_the_schema(claude, model_name) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    made = create(
        claude, model_name, max_tokens=30, output_config={"format": {"type": "json_schema", "schema": schema}}
    )
    jsonschema.validate(json.loads(made.content[0].text), schema)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"max_tokens": None}, "max_tokens"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}]}]},
            "an image source must be",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}}
                        ],
                    }
                ]
            },
            "messages.0.content.0: this model takes no image input",
        ),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
        ({"tool_choice": {"type": "any"}}, "needs tools"),
        ({"temperature": 1.5}, "temperature"),
        ({"container": "c1"}, "container"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "does not think"),
    ],
)
def test_bad_requests_are_anthropic_400s(http, model_name, body, words) -> None:
    request = {"model": model_name, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], **body}
    reply = http.post(f"{ENDPOINT}/openai/v1/messages", json={k: v for k, v in request.items() if v is not None})
    assert reply.status_code == 400, reply.text
    error = reply.json()
    check_error(error)
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"]


def test_the_sdk_raises_anthropics_errors(claude, http) -> None:
    with pytest.raises(anthropic.NotFoundError) as unknown:
        create(claude, "no-such-model")
    assert unknown.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.count_tokens(model="x", messages=[])
    broken = http.post("/openai/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert broken.status_code == 400 and broken.json()["error"]["type"] == "invalid_request_error"
    check_error(broken.json())


def test_an_error_names_the_block_it_is_about(claude, model_name) -> None:
    # The chat route names the part in `param`; Anthropic's errors have none, so the message names it.
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as refused:
        create(
            claude, model_name, messages=[{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}]
        )
    assert refused.value.body["error"]["message"] == "messages.0.content.1: this model takes no image input"


def test_a_tool_result_must_answer_a_tool_use_of_the_previous_message(claude, model_name) -> None:
    question = {"role": "user", "content": "What is the weather in Paris?"}
    called = {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris"}}],
    }
    answered = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "21 C"}]}
    stray = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_99", "content": "21 C"}]}
    assert create(claude, model_name, tools=[WEATHER], max_tokens=2, messages=[question, called, answered]).content
    for messages, where in (([question, called, stray], "messages.2.content.0"), ([stray], "messages.0.content.0")):
        with pytest.raises(anthropic.BadRequestError) as refused:
            create(claude, model_name, tools=[WEATHER], max_tokens=2, messages=messages)
        message = refused.value.body["error"]["message"]
        assert message.startswith(f"{where}: unexpected `tool_use_id`") and "toolu_99" in message, message


def test_jobs_run_messages_whole_streamed_and_counted(http, model_name, first) -> None:
    body = {
        "model": model_name,
        "system": SYSTEM,
        "max_tokens": 24,
        "temperature": 0,
        "messages": [{"role": "user", "content": Q}],
    }

    def job(route, payload, status="COMPLETED"):
        reply = http.post("/v2/e/runsync", json={"input": {"openai_route": route, "openai_input": payload}}).json()
        assert reply["status"] == status, reply
        return reply["output"] if status == "COMPLETED" else reply["error"]

    [whole] = job("/v1/messages", body)
    check_message(whole)
    assert whole["content"] == [{"type": "text", "text": first.content[0].text, "citations": None}]
    events = parse_events("".join(job("/v1/messages", {**body, "stream": True})))
    check_stream(events)
    assert (
        "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
        == first.content[0].text
    )
    [counted] = job("/v1/messages/count_tokens", {k: body[k] for k in ("model", "system", "messages")})
    check(counted, "MessageTokensCount")
    assert counted["input_tokens"] == first.usage.input_tokens + first.usage.cache_read_input_tokens
    # A refused job fails with the error object's inner part, as the RunPod SDK fails a job on any "error".
    refused = job("/v1/messages", {**body, "max_tokens": 0}, status="FAILED")
    check(refused, "ErrorObject")
    assert refused["type"] == "invalid_request_error" and "max_tokens" in refused["message"]


def test_x_api_key_and_raw_output_off(custom_worker) -> None:
    claude = sdk(custom_worker)  # the SDK sends its key as x-api-key
    made = create(claude, "custom-name", max_tokens=6)
    assert made.model == "custom-name" and made.content[0].text
    with pytest.raises(anthropic.AuthenticationError) as refused:
        sdk(custom_worker, api_key="wrong").messages.count_tokens(
            model="custom-name", messages=[{"role": "user", "content": Q}]
        )
    assert refused.value.body["error"]["type"] == "authentication_error"
    with custom_worker.http() as http:
        job = {
            "input": {
                "openai_route": "/v1/messages",
                "openai_input": {
                    "model": "custom-name",
                    "max_tokens": 6,
                    "temperature": 0,
                    "stream": True,
                    "messages": [{"role": "user", "content": Q}],
                },
            }
        }
        out = http.post("/runsync", json=job).json()["output"]
    assert all(isinstance(group, list) for group in out)  # lists of event objects, RunPod's non-raw form
    check_stream([e for group in out for e in group])
    kinds = [e["type"] for group in out for e in group]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-1] == "message_stop"
    text = "".join(e["delta"].get("text", "") for group in out for e in group if e["type"] == "content_block_delta")
    assert text == made.content[0].text


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_forced_tool_use_cut_by_max_tokens_shows_no_markup(claude, model_name, choice) -> None:
    # Six tokens end the answer just after the call's opener ("<tool_call>\n"), before its name.
    ask = {
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER],
        "tool_choice": choice,
        "max_tokens": 6,
    }
    made = create(claude, model_name, **ask)
    assert made.stop_reason == "max_tokens"
    assert not any(block.type == "text" and block.text for block in made.content), made.content
    with stream(claude, model_name, **ask) as s:
        texts = [e.delta.text for e in s if e.type == "content_block_delta" and e.delta.type == "text_delta"]
        final = s.get_final_message()
    assert final.stop_reason == "max_tokens" and not "".join(texts)
    assert not any(block.type == "text" and block.text for block in final.content), final.content
