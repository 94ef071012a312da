"""The Responses API's structured outputs (text.format, the SDK's parse helper) and tools (function_call items,
function_call_output) through the official openai client against the local endpoint; every response, event and
item is validated against OpenAI's spec (openai_schema.py)."""

from __future__ import annotations

from openai_schema import validate
from responses_client import Q, respond


def test_text_format_constrains_the_output_to_the_schema(client, model_name) -> None:
    import json

    import jsonschema

    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome", "Madrid"]},
            "population_millions": {"type": "integer", "minimum": 0, "maximum": 50},
        },
        "required": ["city", "population_millions"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "city", "schema": schema, "strict": True}
    made = respond(client, model_name, text={"format": fmt}, max_output_tokens=60)
    jsonschema.validate(json.loads(made.output_text), schema)
    assert made.text.format.type == "json_schema" and made.text.format.name == "city"
    with client.responses.stream(
        model=model_name, input=Q, text={"format": fmt}, max_output_tokens=60, temperature=0
    ) as stream:
        streamed = stream.get_final_response()
    assert streamed.output_text == made.output_text
    loose = respond(client, model_name, text={"format": {"type": "json_object"}}, max_output_tokens=60)
    assert loose.output_text.lstrip().startswith("{")  # a JSON object, cut off or not
    assert loose.status == "incomplete" or isinstance(json.loads(loose.output_text), dict)


def test_the_sdk_parse_helper_reads_a_pydantic_model(client, model_name) -> None:
    from pydantic import BaseModel

    class Answer(BaseModel):
        city: str
        country: str

    parsed = client.responses.parse(model=model_name, input=Q, text_format=Answer, max_output_tokens=60, temperature=0)
    assert isinstance(parsed.output_parsed, Answer) and parsed.output_parsed.city


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


def test_forced_tool_calls_are_function_call_items_whole_and_streamed(client, model_name) -> None:
    import json

    import jsonschema

    ask = {
        "input": "What is the weather in Paris?",
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 40,
    }
    made = respond(client, model_name, **ask)
    calls = [item for item in made.output if item.type == "function_call"]
    assert len(calls) == 1 and made.status == "completed" and calls[0].name == "get_weather"
    assert calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    assert "<tool_call>" not in made.output_text  # no markup reaches the text
    with client.responses.stream(model=model_name, temperature=0, **ask) as stream:
        events = list(stream)
        final = stream.get_final_response()
    for event in events:
        validate(event)
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    fragments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [streamed_call] = [item for item in final.output if item.type == "function_call"]
    assert fragments == streamed_call.arguments == calls[0].arguments
    named = respond(client, model_name, **{**ask, "tool_choice": {"type": "function", "name": "get_weather"}})
    assert [item.name for item in named.output if item.type == "function_call"] == ["get_weather"]


def test_a_tool_result_goes_back_as_function_call_output(client, model_name) -> None:
    first = respond(
        client,
        model_name,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=40,
    )
    [call] = [item for item in first.output if item.type == "function_call"]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny", "celsius": 21}'}
    chained = respond(
        client,
        model_name,
        input=[result],
        previous_response_id=first.id,
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=30,
    )
    replayed = respond(
        client,
        model_name,
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=30,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            *[item.model_dump(exclude_none=True) for item in first.output],
            result,
        ],
    )
    assert chained.output_text and chained.output_text == replayed.output_text
    assert not [item for item in chained.output if item.type == "function_call"]


def test_output_items_keep_reasoning_text_and_calls_in_order() -> None:
    """The item builder alone, on the events a reasoning model with tools yields (the default model has no
    reasoning parser): every event and item checks against the spec, in the order the model wrote them."""
    import itertools

    from worker.openai.responses.output import OutputItems
    from worker.openai.tools.events import ContentDelta, ReasoningDelta, ToolCallArguments, ToolCallStarted

    numbers = itertools.count()
    items = OutputItems(lambda kind, **f: {"type": kind, "sequence_number": next(numbers), **f}, 0, False)
    events = items.push([ReasoningDelta("The user "), ReasoningDelta("wants weather."), ContentDelta("Checking.")])
    events += items.push(
        [
            ToolCallStarted(0, "call_1", "get_weather"),
            ToolCallArguments(0, '{"city": '),
            ToolCallArguments(0, '"Paris"}'),
        ]
    )
    events += items.finish("completed")
    for event in events:
        validate(event)
    assert [i["type"] for i in items.items] == ["reasoning", "message", "function_call"]
    assert items.items[0]["content"][0]["text"] == "The user wants weather."
    assert items.items[1]["content"][0]["text"] == "Checking."
    assert items.items[2]["arguments"] == '{"city": "Paris"}' and items.items[2]["call_id"] == "call_1"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert all(e["output_index"] == 2 for e in events if e["type"].startswith("response.function_call"))
