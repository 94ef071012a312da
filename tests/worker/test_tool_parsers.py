"""Every tool-call parser on answers written in its family's published format, whole and streamed.

Streamed, each answer is split at every character boundary (and fed one character at a time): the joined
deltas must give the whole answer's content and calls, and no piece of markup may reach the content.
"""

from __future__ import annotations

import json

import pytest

from worker.openai.tools.events import ContentDelta, ToolCallArguments, ToolCallStarted, fold_calls, fold_text
from worker.openai.tools.gemma4 import Gemma4Parser
from worker.openai.tools.generic import GenericParser
from worker.openai.tools.hermes import HermesParser
from worker.openai.tools.llama3_json import Llama3JsonParser
from worker.openai.tools.mistral import MistralParser
from worker.openai.tools.parser import ToolParser

SF = {"location": "San Francisco, CA, USA"}
# (parser, answer, expected content, expected [(name, arguments object)]); the answers follow each family's docs.
CASES = [
    # Qwen2.5 / Qwen3 function-calling guide: one block per call, each on its own lines.
    (
        HermesParser,
        '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, '
        'USA", "date": "2024-10-01"}}\n</tool_call>',
        None,
        [("get_current_temperature", SF), ("get_temperature_date", {**SF, "date": "2024-10-01"})],
    ),
    # Hermes 2 Pro: text before the call, arguments with nesting, quotes and braces inside strings.
    (
        HermesParser,
        'Let me look that up.\n<tool_call>\n{"arguments": {"symbol": "TSLA"}, "name": "get_stock_fundamentals"}\n'
        "</tool_call>",
        "Let me look that up.",
        [("get_stock_fundamentals", {"symbol": "TSLA"})],
    ),
    (
        HermesParser,
        '<tool_call>\n{"name": "run", "arguments": {"code": "print(\\"}</tool_call>{\\")", "opts": {"a": [1, {"b": '
        'null}]}, "emoji": "\u00e9\u4e2d"}}\n</tool_call>',
        None,
        [("run", {"code": 'print("}</tool_call>{")', "opts": {"a": [1, {"b": None}]}, "emoji": "\u00e9\u4e2d"})],
    ),
    (
        HermesParser,
        "The capital of France is Paris. 2 < 3 and <b>bold</b>.",
        "The capital of France is Paris. 2 < 3 and <b>bold</b>.",
        [],
    ),
    (HermesParser, "Almost a call: <tool_ca", "Almost a call: <tool_ca", []),
    (
        HermesParser,
        "<tool_call>\nnot json at all\n</tool_call> and more",
        "<tool_call>\nnot json at all\n</tool_call> and more",
        [],
    ),
    (
        GenericParser,
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n',
        "Sure.",
        [("get_weather", {"city": "Paris"})],
    ),
    # Llama 3.1 model card: the JSON-based call with "parameters"; <|python_tag|> when kept in the text.
    (
        Llama3JsonParser,
        '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}',
        None,
        [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})],
    ),
    (
        Llama3JsonParser,
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": '
        '{"tz": "CET"}}',
        None,
        [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})],
    ),
    (Llama3JsonParser, 'Here is JSON: {"name": "x"}', 'Here is JSON: {"name": "x"}', []),
    (
        Llama3JsonParser,
        'Checking. {"name": "get_weather", "parameters": {"city": "Paris"}}',
        "Checking.",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        Llama3JsonParser,
        'Bob is {"name": "Bob", "age": 3} and {"name":',
        'Bob is {"name": "Bob", "age": 3} and {"name":',
        [],
    ),
    (Llama3JsonParser, '{"answer": 42} is the object.', '{"answer": 42} is the object.', []),
    # Mistral 7B v0.3 / Nemo: a JSON list after [TOOL_CALLS].
    (
        MistralParser,
        '[TOOL_CALLS] [{"name": "get_current_weather", '
        '"arguments": {"location": "Paris, France", "format": "celsius"}}, '
        '{"name": "get_current_weather", "arguments": {"location": "Rome, Italy", "format": "celsius"}}]',
        None,
        [
            ("get_current_weather", {"location": "Paris, France", "format": "celsius"}),
            ("get_current_weather", {"location": "Rome, Italy", "format": "celsius"}),
        ],
    ),
    # Mistral Small 3.2 / Magistral (tokenizer v11+): name[ARGS]{...} after each [TOOL_CALLS].
    (
        MistralParser,
        'I will check both.[TOOL_CALLS]get_current_weather[ARGS]{"location": "Paris, France"}[TOOL_CALLS]get_time'
        "[ARGS]{}",
        "I will check both.",
        [("get_current_weather", {"location": "Paris, France"}), ("get_time", {})],
    ),
    (MistralParser, "No tools needed [TOOL", "No tools needed [TOOL", []),
    # Gemma 4: call:NAME{key:value} per <|tool_call>, strings in <|"|> (commas, braces, quotes, markup inside),
    # bare keys, numbers and literals, nested objects and arrays, several calls in a row; <|tool_response> after.
    (
        Gemma4Parser,
        'Checking both.<|tool_call>call:get_weather{location:<|"|>Paris, {FR} "centre" <tool_call|> \\o/<|"|>,'
        'days:[1,-2.5,3e2],opts:{deep:{on:true,off:false,none:null},list:[{a:<|"|>x<|"|>},[]]}}<tool_call|>'
        '<|tool_call>call:get_time{<|"|>time zone<|"|>:<|"|>CET<|"|>}<tool_call|><|tool_response>',
        "Checking both.",
        [
            (
                "get_weather",
                {
                    "location": 'Paris, {FR} "centre" <tool_call|> \\o/',
                    "days": [1, -2.5, 300.0],
                    "opts": {"deep": {"on": True, "off": False, "none": None}, "list": [{"a": "x"}, []]},
                },
            ),
            ("get_time", {"time zone": "CET"}),
        ],
    ),
    (
        Gemma4Parser,
        '<|tool_call>call:get_time{}<tool_call|>\n<|tool_call>call:f{s:<|"|>a<b <|x<|"|>,n:007}<tool_call|>',
        None,
        [("get_time", {}), ("f", {"s": "a<b <|x", "n": 7})],
    ),
    (Gemma4Parser, "Almost a call: <|tool_c", "Almost a call: <|tool_c", []),
    (Gemma4Parser, "<|tool_call>not a call<tool_call|> and more", "<|tool_call>not a call<tool_call|> and more", []),
]


def _stream(parser: ToolParser, pieces: list[str]) -> list:
    events = []
    for piece in pieces:
        events += parser.push(piece)
    return events + parser.finish()


def _summary(events: list) -> tuple[str | None, list[tuple[str, object]]]:
    calls = fold_calls(events)
    content = fold_text(events, ContentDelta)
    return ((content or None) if calls else content), [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("cls,text,content,calls", CASES, ids=lambda v: getattr(v, "name", None))
def test_whole_answers_parse_into_content_and_calls(cls, text, content, calls) -> None:
    parsed_content, parsed_calls = cls.parse(text)
    assert parsed_content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed_calls] == calls
    assert all(c.id.startswith("call_") and c.id[-9:].isalnum() for c in parsed_calls)
    assert len({c.id for c in parsed_calls}) == len(parsed_calls)


@pytest.mark.parametrize("cls,text,content,calls", CASES, ids=lambda v: getattr(v, "name", None))
def test_streamed_at_every_split_the_deltas_join_into_the_whole_answer(cls, text, content, calls) -> None:
    whole_content, whole_calls = cls.parse(text)
    whole = (whole_content, [(c.name, c.arguments) for c in whole_calls])
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        events = _stream(cls(), pieces)
        got_calls = fold_calls(events)
        got_content = fold_text(events, ContentDelta)
        assert (
            (got_content or None) if got_calls else got_content,
            [(c.name, c.arguments) for c in got_calls],
        ) == whole, pieces
        if calls:  # no piece of the markup reaches the content
            for marker in (
                "<tool_call>",
                "</tool_call>",
                "[TOOL_CALLS]",
                "[ARGS]",
                "<|python_tag|>",
                '"name"',
                "<|tool_call>",
                "<tool_call|>",
                '<|"|>',
                "call:",
            ):
                assert marker not in got_content
        # Each call opens once, with its name, before any of its arguments.
        opened: set[int] = set()
        for event in events:
            if isinstance(event, ToolCallStarted):
                assert event.index not in opened and event.name
                opened.add(event.index)
            elif isinstance(event, ToolCallArguments):
                assert event.index in opened


def test_arguments_stream_as_they_are_written() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": {"text": "a long argument"}}\n</tool_call>'
    parser = HermesParser()
    events = [e for ch in text for e in parser.push(ch)] + parser.finish()
    fragments = [e.fragment for e in events if isinstance(e, ToolCallArguments)]
    assert len(fragments) > 10 and "".join(fragments) == '{"text": "a long argument"}'
    assert isinstance(events[0], ToolCallStarted) and events[0].name == "f"


def test_parallel_tool_calls_false_keeps_the_first_call_only() -> None:
    text = (
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n'
        "</tool_call>"
    )
    assert [c.name for c in HermesParser.parse(text, parallel=False)[1]] == ["a"]
    assert [c.name for c in HermesParser.parse(text)[1]] == ["a", "b"]
    listed = '[TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]'
    assert [c.name for c in MistralParser.parse(listed, parallel=False)[1]] == ["a"]


def test_a_call_cut_short_keeps_what_was_written_and_text_after_calls_is_dropped() -> None:
    content, calls = HermesParser.parse('<tool_call>\n{"name": "f", "arguments": {"q": "Par')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("f", '{"q": "Par')]
    content, calls = HermesParser.parse('<tool_call>{"name": "f", "arguments": {}}</tool_call> I called f.')
    assert content is None and [c.name for c in calls] == ["f"]


def test_whitespace_before_a_call_is_not_content_but_stays_inside_plain_text() -> None:
    assert HermesParser.parse('\n\n<tool_call>{"name": "f"}</tool_call>')[0] is None
    assert HermesParser.parse("  indented\n\n")[0] == "  indented\n\n"
    assert HermesParser.parse("") == ("", [])


CELSIUS, FAHRENHEIT = {"city": "Paris", "unit": "celsius"}, {"city": "Paris", "unit": "fahrenheit"}
C_ARGS, F_ARGS = json.dumps(CELSIUS), json.dumps(FAHRENHEIT)
C_CALL = f'{{"name": "get_weather", "arguments": {C_ARGS}}}'
F_CALL = f'{{"name": "get_weather", "arguments": {F_ARGS}}}'
C_AGAIN = C_CALL.replace(", ", ",\n    ")  # the same call, spaced otherwise
L_C, L_F, L_AGAIN = (c.replace('"arguments"', '"parameters"') for c in (C_CALL, F_CALL, C_AGAIN))
G_CALL = '<|tool_call>call:get_weather{{city:<|"|>Paris<|"|>,unit:<|"|>{}<|"|>}}<tool_call|>'
# (parser, answer whose third call repeats the first, that repeat): the default model's loop, in each format.
REPEATS = [
    (HermesParser, "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in (C_CALL, F_CALL, C_AGAIN, F_CALL)), C_AGAIN),
    (Llama3JsonParser, "; ".join((L_C, L_F, L_AGAIN, L_F)), L_AGAIN),
    (MistralParser, f"[TOOL_CALLS] [{C_CALL}, {F_CALL}, {C_AGAIN}, {F_CALL}]", C_AGAIN),
    (
        MistralParser,
        "".join(f"[TOOL_CALLS]get_weather[ARGS]{a}" for a in (C_ARGS, F_ARGS, C_ARGS, F_ARGS)),
        f"[TOOL_CALLS]get_weather[ARGS]{C_ARGS}",
    ),
    (
        Gemma4Parser,
        "".join(G_CALL.format(u) for u in ("celsius", "fahrenheit", "celsius", "fahrenheit")),
        G_CALL.format("celsius").removesuffix("<tool_call|>"),
    ),
]


@pytest.mark.parametrize("cls,text,repeat", REPEATS, ids=lambda v: getattr(v, "name", None))
def test_a_call_that_repeats_an_earlier_one_ends_the_answer_without_it(cls, text, repeat) -> None:
    expected = [("get_weather", CELSIUS), ("get_weather", FAHRENHEIT)]
    assert [(c.name, json.loads(c.arguments)) for c in cls.parse(text)[1]] == expected
    end = text.index(repeat, len(repeat)) + len(repeat)  # where the repeat is written out
    for pieces in ([text[: end - 1], text[end - 1 :]], list(text)):
        parser, events, read, ended_at = cls(), [], 0, None
        for piece in pieces:
            events += parser.push(piece)
            read += len(piece)
            ended_at = ended_at or (read if parser.done else None)
        events += parser.finish()
        assert _summary(events) == (None, expected)
        # The answer ends as the repeat's arguments close, not before.
        assert ended_at == (end if len(pieces) > 2 else len(text))
        assert all(getattr(e, "index", 0) < 2 for e in events)  # no part of the repeat was streamed


def test_a_call_like_an_earlier_one_streams_as_soon_as_it_differs() -> None:
    text = f"<tool_call>\n{C_CALL}\n</tool_call>\n<tool_call>\n{F_CALL}\n</tool_call>"
    parser, events = HermesParser(), []
    differs = text.rindex('"fahrenheit"') + 2  # "f where "c was
    for i, ch in enumerate(text):
        events += parser.push(ch)
        if i + 1 == differs - 1:
            assert not any(isinstance(e, ToolCallStarted) and e.index == 1 for e in events)
        if i + 1 == differs:
            assert any(isinstance(e, ToolCallStarted) and e.index == 1 for e in events)
    assert _summary(events + parser.finish()) == (None, [("get_weather", CELSIUS), ("get_weather", FAHRENHEIT)])


def test_a_call_past_max_calls_ends_the_answer_once_it_is_named() -> None:
    calls = [f'<tool_call>\n{{"name": "{n}", "arguments": {{}}}}\n</tool_call>' for n in "abc"]
    text = "\n".join(calls)
    assert [c.name for c in HermesParser.parse(text, max_calls=2)[1]] == ["a", "b"]
    assert [c.name for c in HermesParser.parse(text, max_calls=3)[1]] == ["a", "b", "c"]
    parser = HermesParser(max_calls=2)
    named = text.rindex('"c"') + 3
    events = parser.push(text[: named - 1])
    assert not parser.done
    events += parser.push(text[named - 1 : named]) + parser.push(text[named:]) + parser.finish()
    assert parser.done and [c.name for c in fold_calls(events)] == ["a", "b"]


def test_gemma4_arguments_stream_as_they_are_written() -> None:
    text = '<|tool_call>call:f{text:<|"|>a long argument<|"|>,n:12}<tool_call|>'
    parser = Gemma4Parser()
    events = [e for ch in text for e in parser.push(ch)] + parser.finish()
    fragments = [e.fragment for e in events if isinstance(e, ToolCallArguments)]
    assert len(fragments) > 10 and "".join(fragments) == '{"text": "a long argument", "n": 12}'
    assert isinstance(events[0], ToolCallStarted) and events[0].name == "f"
    # Cut short inside a string: what was written stays, as for the JSON formats.
    content, calls = Gemma4Parser.parse('<|tool_call>call:f{q:<|"|>Par')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("f", '{"q": "Par')]
