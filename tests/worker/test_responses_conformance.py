"""/v1/responses against the Open Responses specification and OpenAI's published schema (open_responses_schema.py):
the response object's required fields, assistant messages' `phase`, echoed tools, a required `model`, and
POST /v1/responses/compact."""

from __future__ import annotations

import jsonschema
import openai
import pytest
from open_responses_schema import ITEM, check_compaction, check_response
from openai_schema import parse_events, validate

Q = "What is the capital of France?"
TOOL = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
    },
}


def test_a_response_and_its_stream_meet_the_spec(http, model_name) -> None:
    body = {"model": model_name, "input": Q, "max_output_tokens": 5, "temperature": 0}
    made = check_response(validate(http.post("/openai/v1/responses", json=body).json()))
    assert made["presence_penalty"] == 0 and made["frequency_penalty"] == 0 and "user" not in made
    assert made["safety_identifier"] is None and made["prompt_cache_key"] is None  # as OpenAI returns them
    [message] = made["output"]
    assert message["phase"] == "final_answer"
    penalised = check_response(
        http.post(
            "/openai/v1/responses", json={**body, "presence_penalty": 0.5, "frequency_penalty": -0.5, "user": "u1"}
        ).json()
    )
    assert penalised["presence_penalty"] == 0.5 and penalised["frequency_penalty"] == -0.5
    assert penalised["user"] == "u1"
    with http.stream("POST", "/openai/v1/responses", json={**body, "stream": True}) as reply:
        events = [validate(e) for e in parse_events("".join(reply.iter_text()))]
    for event in events:
        if "response" in event:  # created, in_progress, then incomplete: each carries the whole object
            check_response(event["response"])
        if event["type"].startswith("response.output_item."):
            jsonschema.validate(event["item"], ITEM)
    created = events[0]["response"]["usage"]
    assert created["input_tokens"] == made["usage"]["input_tokens"] and created["output_tokens"] == 0
    assert events[-1]["response"]["output"][0]["phase"] == "final_answer"


def test_echoed_tools_and_formats_name_every_field(client, model_name) -> None:
    made = client.responses.create(
        model=model_name,
        input="Weather in Paris?",
        tools=[TOOL],
        tool_choice="required",
        max_output_tokens=30,
        temperature=0,
    )
    echoed = check_response(validate(made))
    assert echoed["tools"][0] | {"parameters": None} == {
        "type": "function",
        "name": "get_weather",
        "description": None,
        "parameters": None,
        "strict": None,
    }
    assert [item.type for item in made.output] == ["function_call"]
    fmt = {"type": "json_schema", "name": "city", "schema": {"type": "object"}}
    shaped = client.responses.create(model=model_name, input=Q, text={"format": fmt}, max_output_tokens=5)
    assert check_response(validate(shaped))["text"]["format"] == {**fmt, "description": None, "strict": False}


def test_a_message_before_a_call_is_commentary() -> None:
    """The item builder alone (the baked model does not write text before a call): a message that more output
    follows is commentary, the last one the final answer."""
    from worker.openai.responses.output import OutputItems
    from worker.openai.tools.events import ContentDelta, ToolCallArguments, ToolCallStarted

    items = OutputItems(lambda kind, **fields: {"type": kind, **fields}, 0, False)
    items.push(
        [
            ContentDelta("Checking."),
            ToolCallStarted(0, "call_1", "get_weather"),
            ToolCallArguments(0, "{}"),
            ContentDelta("Done."),
        ]
    )
    items.finish("completed")
    assert [(i["type"], i.get("phase")) for i in items.items] == [
        ("message", "commentary"),
        ("function_call", None),
        ("message", "final_answer"),
    ]


def test_a_replayed_phase_is_kept_and_a_bad_one_refused(client, http, model_name) -> None:
    said = {"type": "message", "role": "assistant", "content": "Paris.", "phase": "final_answer"}
    made = client.responses.create(
        model=model_name,
        input=[{"role": "user", "content": Q}, said, {"role": "user", "content": "And Italy?"}],
        max_output_tokens=4,
    )
    listed = http.get(f"/openai/v1/responses/{made.id}/input_items", params={"order": "asc"}).json()
    assert listed["data"][1]["phase"] == "final_answer"
    for where, item in (
        ("input[0].phase", {**said, "phase": "draft"}),
        ("input[0].phase", {"role": "user", "content": Q, "phase": "final_answer"}),
    ):
        reply = http.post("/openai/v1/responses", json={"model": model_name, "input": [item]})
        assert reply.status_code == 400 and validate(reply.json())["error"]["param"] == where


@pytest.mark.parametrize("route", ["/openai/v1/responses", "/openai/v1/responses/compact"])
def test_a_missing_model_is_refused_as_on_the_chat_route(http, route) -> None:
    reply = http.post(route, json={"input": Q})
    assert reply.status_code == 400 and validate(reply.json())["error"]["param"] == "model"


def test_compact_keeps_the_user_messages_and_summarises_the_rest(client, http, model_name) -> None:
    turns = [
        {"role": "user", "content": "My name is Alice and I live in Lyon."},
        {"role": "assistant", "content": "Nice to meet you, Alice from Lyon!"},
        {"role": "user", "content": "I like cycling."},
        {"role": "assistant", "content": "Cycling is great."},
    ]
    compacted = client.responses.compact(model=model_name, input=turns)
    # Against Open Responses' CompactResource only: the SDK types `output` as output items, which a user
    # message (input_text content) is not, though OpenAI documents the user messages as part of it.
    check_compaction(compacted.model_dump(exclude_unset=True))
    *users, compaction = compacted.output
    assert [u.content[0].text for u in users] == [turns[0]["content"], turns[2]["content"]]
    assert compaction.type == "compaction" and compaction.id.startswith("cmp_") and compaction.encrypted_content
    assert compacted.usage.output_tokens > 0
    # The compacted window is an input like any other; the summary reaches the model.
    follow = {"role": "user", "content": "Where do I live?"}
    window = [item.model_dump(exclude_none=True) for item in compacted.output]
    resumed = client.responses.create(model=model_name, input=[*window, follow], max_output_tokens=4)
    without = client.responses.create(model=model_name, input=[*window[:-1], follow], max_output_tokens=4)
    assert resumed.usage.input_tokens > without.usage.input_tokens
    # From a stored response too: its user messages come first.
    stored = client.responses.create(model=model_name, input=turns[:1], max_output_tokens=4)
    chained = client.responses.compact(model=model_name, previous_response_id=stored.id, input="I like cycling.")
    assert [item.content[0].text for item in chained.output[:-1]] == [turns[0]["content"], "I like cycling."]
    # Only this worker's compactions are taken back, and the body is OpenAI's.
    forged = http.post(
        "/openai/v1/responses",
        json={"model": model_name, "input": [{"type": "compaction", "encrypted_content": "bm90IG91cnM="}]},
    )
    assert forged.status_code == 400 and forged.json()["error"]["param"] == "input[0].encrypted_content"
    with pytest.raises(openai.BadRequestError) as extra:
        client.responses.compact(model=model_name, input=Q, extra_body={"stream": True})
    assert extra.value.body["param"] == "stream"
