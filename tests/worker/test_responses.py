"""The Responses API (/v1/responses) through the official openai client against the local endpoint.

Every response, event and item list is validated against OpenAI's spec (openai_schema.py). Answers
are compared with other answers of the same model (the chat route, a replayed conversation), never
with hard-coded text.
"""

from __future__ import annotations

import openai
import pytest
from openai_schema import parse_events, validate
from responses_client import Q, respond


@pytest.fixture(scope="module")
def first(client, model_name):
    return respond(
        client,
        model_name,
        instructions="Answer in one sentence.",
        metadata={"run": "a"},
        user="tester",
        max_output_tokens=40,
    )


def test_a_response_is_the_chat_answer_as_a_message_item(client, model_name, first) -> None:
    assert first.id.startswith("resp_") and first.object == "response" and first.status == "completed"
    assert first.model == model_name and first.error is None and first.incomplete_details is None
    [item] = first.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert item.id.startswith("msg_") and item.content[0].annotations == []
    assert first.output_text == item.content[0].text and first.output_text
    chat = client.chat.completions.create(
        model=model_name,
        max_tokens=40,
        temperature=0,
        messages=[{"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": Q}],
    )
    assert first.output_text == chat.choices[0].message.content
    usage = first.usage
    assert usage.input_tokens == chat.usage.prompt_tokens and usage.output_tokens == chat.usage.completion_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    # The request's settings, echoed.
    assert first.instructions == "Answer in one sentence." and first.metadata == {"run": "a"}
    assert first.user == "tester" and first.max_output_tokens == 40 and first.temperature == 0
    assert first.store is True and first.tools == [] and first.tool_choice == "auto" and first.truncation == "disabled"


def test_a_cut_off_response_is_incomplete_with_the_reason(client, model_name) -> None:
    cut = respond(client, model_name, input="Tell me a long story about a dragon.", max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3 and cut.output[0].status == "incomplete"


def test_the_stream_helper_sees_openai_event_order_and_the_same_text(client, model_name, first) -> None:
    with client.responses.stream(
        model=model_name, input=Q, instructions="Answer in one sentence.", max_output_tokens=40, temperature=0
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    for event in events:
        validate(event)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == first.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert final.usage.output_tokens == first.usage.output_tokens


def test_raw_sse_names_each_event_and_sends_no_done(http, model_name) -> None:
    body = {"model": model_name, "input": Q, "max_output_tokens": 4, "temperature": 0, "stream": True}
    with http.stream("POST", "/openai/v1/responses", json=body) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        text = "".join(reply.iter_text())
    assert "[DONE]" not in text
    events = [validate(e) for e in parse_events(text)]
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_replayed_output_items_and_previous_response_id_give_the_same_turn(client, model_name, first) -> None:
    follow = "And what is the capital of Italy?"
    chained = respond(
        client, model_name, input=follow, previous_response_id=first.id, instructions="Answer in one sentence."
    )
    replay = [
        {"role": "user", "content": Q},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"role": "user", "content": follow},
    ]
    replayed = respond(client, model_name, input=replay, instructions="Answer in one sentence.")
    assert chained.previous_response_id == first.id
    assert chained.usage.input_tokens == replayed.usage.input_tokens > first.usage.input_tokens
    assert chained.output_text == replayed.output_text
    # The chain goes on from the second turn as well.
    third = respond(client, model_name, input="And of Spain?", previous_response_id=chained.id)
    assert third.usage.input_tokens > chained.usage.input_tokens


def test_stored_responses_can_be_read_listed_and_deleted(client, model_name) -> None:
    made = respond(
        client,
        model_name,
        input=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "input_text", "text": Q}]},
        ],
    )
    again = client.responses.retrieve(made.id)
    validate(again)
    assert again.id == made.id and again.output_text == made.output_text
    items = client.responses.input_items.list(made.id)
    validate(items)
    assert [i.role for i in items.data] == ["user", "developer"]  # newest first, as OpenAI lists them
    assert items.data[0].content[0].text == Q and items.first_id == items.data[0].id and not items.has_more
    page = client.responses.input_items.list(made.id, order="asc", limit=1)
    assert [i.role for i in page.data] == ["developer"] and page.has_more
    after = client.responses.input_items.list(made.id, order="asc", after=page.last_id)
    assert [i.role for i in after.data] == ["user"]
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.create(model=model_name, input="Hi", previous_response_id=made.id)
    assert gone.value.body["param"] == "previous_response_id"


def test_store_false_keeps_nothing(client, model_name) -> None:
    made = respond(client, model_name, input="Hi", store=False, max_output_tokens=2)
    assert made.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)


def test_logprobs_come_with_the_include_flag(client, model_name) -> None:
    made = respond(client, model_name, include=["message.output_text.logprobs"], top_logprobs=2, max_output_tokens=5)
    logprobs = made.output[0].content[0].logprobs
    assert len(logprobs) == made.usage.output_tokens == 5
    assert all(len(lp.top_logprobs) == 2 and lp.top_logprobs[0].logprob >= lp.logprob for lp in logprobs)
    assert "".join(lp.token for lp in logprobs) == made.output_text
    plain = respond(client, model_name, max_output_tokens=5, top_logprobs=2)
    assert plain.output[0].content[0].logprobs == []
    with client.responses.stream(
        model=model_name,
        input=Q,
        max_output_tokens=5,
        temperature=0,
        top_logprobs=1,
        include=["message.output_text.logprobs"],
    ) as stream:
        deltas = [e for e in stream if e.type == "response.output_text.delta"]
    assert sum(len(e.logprobs) for e in deltas) == 5


def test_tokens_inside_a_character_keep_their_logprobs(client, model_name, tokenizer) -> None:
    """Tokens that bring no text yet (the first bytes of an emoji) hand their logprobs to the next text."""
    half = tokenizer.encode("🔥", add_special_tokens=False)[0]
    ask = {
        "include": ["message.output_text.logprobs"],
        "max_output_tokens": 4,
        "extra_body": {"allowed_token_ids": [half]},
    }
    made = respond(client, model_name, **ask)
    assert len(made.output[0].content[0].logprobs) == made.usage.output_tokens == 4
    with client.responses.stream(model=model_name, input=Q, temperature=0, **ask) as stream:
        deltas = [e for e in stream if e.type == "response.output_text.delta"]
    assert sum(len(e.logprobs) for e in deltas) == 4


def test_tool_items_reasoning_items_and_the_fields_n8n_sends_are_accepted(client, model_name) -> None:
    tool = {
        "type": "function",
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
    made = respond(
        client,
        model_name,
        tools=[tool],
        tool_choice="auto",
        parallel_tool_calls=False,
        service_tier="auto",
        prompt_cache_key="k",
        safety_identifier="u1",
        reasoning={"effort": "low"},
        truncation="auto",
        input=[
            {"type": "message", "role": "user", "content": "Weather in Paris?"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"},
        ],
    )
    assert made.status in ("completed", "incomplete") and made.tools[0].name == "get_weather"
    assert made.parallel_tool_calls is False and made.reasoning.effort == "low"
    kinds = [i.type for i in client.responses.input_items.list(made.id, order="asc").data]
    assert kinds == ["message", "reasoning", "function_call", "function_call_output"]


def test_an_item_reference_reuses_a_stored_item(client, model_name, first) -> None:
    [question] = client.responses.input_items.list(first.id).data
    referenced = respond(
        client,
        model_name,
        input=[{"type": "item_reference", "id": question.id}],
        instructions="Answer in one sentence.",
        max_output_tokens=40,
    )
    assert referenced.output_text == first.output_text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format.name"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "not": {}}}}},
            "text.format",
        ),
        ({"text": {"format": {"type": "json_object"}}, "guided_regex": "a+"}, "guided_regex"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "item_reference", "id": "msg_unknown"}]}, "input[0].id"),
        ({"input": []}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"include": ["nothing.real"]}, "include[0]"),
        ({"background": True}, "background"),
        ({"n": 2}, "n"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"temperature": 3}, "temperature"),
        ({"truncation": "sometimes"}, "truncation"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_bad_requests_are_400s_naming_the_parameter(http, model_name, body, param) -> None:
    reply = http.post("/openai/v1/responses", json={"model": model_name, "input": "Hi", **body})
    assert reply.status_code == 400, reply.text
    assert validate(reply.json())["error"]["param"] == param


def test_a_missing_input_and_an_unknown_model_are_refused(http, model_name) -> None:
    missing = http.post("/openai/v1/responses", json={"model": model_name})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "input"
    unknown = http.post("/openai/v1/responses", json={"model": "nope", "input": "Hi"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_a_context_overflow_is_refused_unless_truncation_is_auto(client, model_name) -> None:
    long_turns = []
    for i in range(12):  # about 2,400 tokens of history against the test worker's 2,048-token context
        long_turns += [
            {"role": "user", "content": f"Note {i}: " + "the quick brown fox jumps " * 40},
            {"role": "assistant", "content": "Noted."},
        ]
    turns = [*long_turns, {"role": "user", "content": Q}]
    with pytest.raises(openai.BadRequestError) as refused:
        respond(client, model_name, input=turns)
    assert refused.value.body["code"] == "context_length_exceeded" and refused.value.body["param"] == "input"
    fitted = respond(client, model_name, input=turns, truncation="auto")
    assert fitted.truncation == "auto" and fitted.usage.input_tokens + fitted.usage.output_tokens <= 2048


def test_the_job_route_runs_responses_whole_and_streamed(http, model_name, first) -> None:
    body = {
        "model": model_name,
        "input": Q,
        "instructions": "Answer in one sentence.",
        "max_output_tokens": 40,
        "temperature": 0,
    }
    whole = http.post("/v2/e/runsync", json={"input": {"openai_route": "/v1/responses", "openai_input": body}}).json()
    assert whole["status"] == "COMPLETED"
    assert validate(whole["output"][0])["output"][0]["content"][0]["text"] == first.output_text
    streamed = http.post(
        "/v2/e/runsync", json={"input": {"openai_route": "/v1/responses", "openai_input": {**body, "stream": True}}}
    ).json()
    events = [validate(e) for e in parse_events("".join(streamed["output"]))]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == first.output_text
    got = http.post("/v2/e/runsync", json={"input": {"openai_route": f"/v1/responses/{first.id}"}}).json()
    assert validate(got["output"][0])["id"] == first.id


def test_raw_output_off_and_the_name_override_hold_for_responses(custom_worker) -> None:
    client = custom_worker.client()
    made = client.responses.create(model="custom-name", input=Q, max_output_tokens=6, temperature=0)
    validate(made)
    assert made.model == "custom-name" and made.output[0].role == "assistant"
    with client.responses.stream(model="custom-name", input=Q, max_output_tokens=6, temperature=0) as stream:
        events = list(stream)
    for event in events:
        validate(event)
    assert events[-1].type == "response.incomplete" or events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == made.output_text
    with custom_worker.http() as http:
        job = {
            "input": {
                "openai_route": "/v1/responses",
                "openai_input": {
                    "model": "custom-name",
                    "input": Q,
                    "max_output_tokens": 6,
                    "temperature": 0,
                    "stream": True,
                },
            }
        }
        out = http.post("/runsync", json=job).json()["output"]
    assert all(isinstance(group, list) for group in out)  # lists of event objects, RunPod's non-raw form
    events = [validate(e) for group in out for e in group]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
