"""gpt-oss's harmony format in the worker, on a real o200k vocabulary (js-tiktoken, see harmony_vocab.py):
prompts render as openai-harmony renders the same conversation, and answers written in harmony (encoded
with that vocabulary) read into reasoning, tool calls and content, whole and split at every token, for
chat deltas and Responses items alike."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import pytest
from harmony_vocab import o200k_folder

from engine.errors import StartupError
from engine.sample.params import SamplingParams
from worker.openai.chat_deltas import delta_dicts
from worker.openai.harmony.chat import harmony_chat
from worker.openai.harmony.encoding import harmony_encoding
from worker.openai.harmony.output import HarmonyFormat
from worker.openai.harmony.render import conversation, render
from worker.openai.responses.output import OutputItems
from worker.openai.tools.definitions import check_tools
from worker.openai.tools.events import ToolCallStarted, fold_calls, fold_text

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TODAY = datetime.date(2025, 6, 1)
MARKUP = ("<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|start|>", "<|constrain|>")


@pytest.fixture(scope="session")
def encoding(request: pytest.FixtureRequest) -> Any:
    folder = o200k_folder(Path(request.config.cache.mkdir("harmony-o200k")))
    return harmony_encoding(str(folder))


def _tokens(encoding: Any, text: str) -> list[int]:
    return list(encoding.encode(text, allowed_special="all"))


def test_a_conversation_renders_as_openai_harmony_renders_it(encoding: Any) -> None:
    from openai_harmony import (
        Author,
        Conversation,
        DeveloperContent,
        Message,
        ReasoningEffort,
        Role,
        SystemContent,
        ToolDescription,
    )

    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I should call the tool.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    ours = render(encoding, conversation(messages, check_tools([WEATHER]), "high", today=TODAY))
    fn = WEATHER["function"]
    expected = Conversation.from_messages(
        [
            Message.from_role_and_content(
                Role.SYSTEM,
                SystemContent.new()
                .with_reasoning_effort(ReasoningEffort.HIGH)
                .with_conversation_start_date("2025-06-01"),
            ),
            Message.from_role_and_content(
                Role.DEVELOPER,
                DeveloperContent.new()
                .with_instructions("Answer briefly.")
                .with_function_tools([ToolDescription.new(fn["name"], fn["description"], fn["parameters"])]),
            ),
            Message.from_role_and_content(Role.USER, "Weather in Paris?"),
            Message.from_role_and_content(Role.ASSISTANT, "I should call the tool.").with_channel("analysis"),
            Message.from_role_and_content(Role.ASSISTANT, '{"city": "Paris"}')
            .with_channel("commentary")
            .with_recipient("functions.get_weather")
            .with_content_type("<|constrain|>json"),
            Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), '{"temp": 21}')
            .with_channel("commentary")
            .with_recipient("assistant"),
        ]
    )
    assert ours == list(encoding.render_conversation_for_completion(expected, Role.ASSISTANT))
    text = encoding.decode(ours)
    # The replayed reasoning stays (the turn has no final answer yet), and the call reads as gpt-oss writes it.
    assert "<|channel|>analysis<|message|>I should call the tool.<|end|>" in text
    assert (
        "to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>" in text
        or "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>" in text
    )
    assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"temp": 21}' in text
    assert "Reasoning: high" in text and "# Instructions\n\nAnswer briefly." in text
    assert text.endswith("<|start|>assistant")


def test_reasoning_before_a_final_answer_is_dropped_from_the_next_prompt(encoding: Any) -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
        {"role": "user", "content": "Bye"},
    ]
    text = encoding.decode(render(encoding, conversation(messages, [], today=TODAY)))
    assert "Greet back." not in text and "<|channel|>final<|message|>Hello!<|end|>" in text
    assert "# Tools" not in text and "<|start|>developer" not in text


ANSWERS = {
    "call": (
        "<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
        "Need the weather tool.",
        None,
        [("get_weather", '{"city": "Paris"}')],
    ),
    "final": (
        "<|channel|>analysis<|message|>Simple: 2+2=4.<|end|><|start|>assistant<|channel|>final<|message|>"
        "The answer is 4 — «sûr» 😀.<|return|>",
        "Simple: 2+2=4.",
        "The answer is 4 — «sûr» 😀.",
        [],
    ),
}


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_an_answer_reads_the_same_whole_and_split_at_every_token(encoding: Any, name: str) -> None:
    text, reasoning, content, calls = ANSWERS[name]
    ids = _tokens(encoding, text)
    fmt = HarmonyFormat(encoding=encoding)
    parsed, reasoning_count = fmt.read("", ids)
    assert parsed.reasoning == reasoning and parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls
    assert reasoning_count == len(_tokens(encoding, reasoning))
    stream = fmt.stream()
    events = [e for token in ids for e in stream.push("", [token])] + stream.finish()
    assert fold_text(events, type(events[0])) == reasoning  # the reasoning streams first
    assert [(c.name, c.arguments) for c in fold_calls(events)] == calls
    assert stream.called == bool(calls)
    # Chat chunks: reasoning under both names, the call as OpenAI streams one, no markup anywhere.
    deltas = delta_dicts(events)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == reasoning
    assert "".join(d.get("content", "") for d in deltas) == (content or "")
    assert not any(m in json.dumps(deltas) for m in MARKUP)
    if calls:
        opened = [d["tool_calls"][0] for d in deltas if "tool_calls" in d and "id" in d["tool_calls"][0]]
        assert len(opened) == 1 and opened[0]["id"].startswith("call_")
        assert opened[0]["function"] == {"name": "get_weather", "arguments": ""}
    # Responses: a reasoning item, then the call or the message, in the order written.
    counter = iter(range(10_000))
    items = OutputItems(lambda kind, **fields: {"type": kind, "sequence_number": next(counter), **fields}, 0, False)
    streamed = items.push(events) + items.finish("completed")
    done = [e["item"] for e in streamed if e["type"] == "response.output_item.done"]
    assert [i["type"] for i in done] == ["reasoning", "function_call" if calls else "message"]
    if calls:
        assert (done[1]["name"], done[1]["arguments"]) == calls[0]
    else:
        assert done[1]["content"][0]["text"] == content


def test_a_named_tool_choice_opens_the_call_in_the_prompt_and_holds_its_arguments(encoding: Any) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    prompt, plan, fmt, params = harmony_chat(
        encoding,
        messages,
        SamplingParams(max_tokens=32),
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert prompt.text.endswith(
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    )
    assert params.structured is not None and json.loads(params.structured.value) == WEATHER["function"]["parameters"]
    assert {200002, 200012} <= set(params.stop_token_ids)  # <|return|> and <|call|> end the answer
    # The model writes only the arguments and <|call|>; the reader knows the header from the prompt.
    parsed, _ = fmt.read("", _tokens(encoding, '{"city": "Oslo"}<|call|>'))
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_weather", '{"city": "Oslo"}')]


def test_tool_choice_none_shows_no_tools_and_a_schema_opens_the_final_channel(encoding: Any) -> None:
    from worker.openai.protocol import ChatCompletionRequest
    from worker.openai.structured import structured_spec

    request = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "Hi"}],
            "tools": [WEATHER],
            "tool_choice": "none",
            "response_format": {"type": "json_schema", "json_schema": {"name": "reply", "schema": {"type": "object"}}},
        }
    )
    params = SamplingParams(structured=structured_spec(response_format=request.response_format))
    prompt, plan, fmt, params = harmony_chat(
        encoding,
        request.messages,
        params,
        tools=request.tools,
        tool_choice="none",
        response_format=request.response_format,
    )
    assert "get_weather" not in prompt.text and "# Response Formats\n\n## reply" in prompt.text
    assert prompt.text.endswith("<|start|>assistant<|channel|>final<|message|>")
    parsed, _ = fmt.read("", _tokens(encoding, '{"a": 1}<|return|>'))
    assert parsed.content == '{"a": 1}' and parsed.reasoning is None


def test_an_unknown_reasoning_effort_is_a_bad_request(encoding: Any) -> None:
    from worker.openai.errors import BadRequest

    with pytest.raises(BadRequest, match="reasoning_effort must be one of low, medium, high"):
        conversation([{"role": "user", "content": "Hi"}], [], "extreme")


def test_a_model_folder_without_the_o200k_file_fails_at_start_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(StartupError) as failure:
        harmony_encoding(str(tmp_path))
    assert "o200k_base.tiktoken is missing" in failure.value.message and "\n" not in failure.value.message


def test_calls_get_fresh_ids(encoding: Any) -> None:
    ids = _tokens(encoding, ANSWERS["call"][0])
    first = [e for e in HarmonyFormat(encoding=encoding).stream().push("", ids) if isinstance(e, ToolCallStarted)]
    second = [e for e in HarmonyFormat(encoding=encoding).stream().push("", ids) if isinstance(e, ToolCallStarted)]
    assert first[0].id != second[0].id
