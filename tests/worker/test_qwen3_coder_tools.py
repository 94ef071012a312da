"""Qwen3-Coder's (Qwen3.5's, Qwen3.6's) XML tool calls: the `qwen3_coder` parser, whole and streamed at every split,
values typed by the tool's schema; its pick from the Qwen3.5 template, which renders tools and a second turn; and
the grammar that holds forced calls to well-formed blocks of the allowed tools with schema-valid values."""

from __future__ import annotations

import json

import jsonschema
import pytest
from family_templates import QWEN3, QWEN35

from worker.openai.chat_template import render_chat, template_messages
from worker.openai.protocol import ChatCompletionRequest
from worker.openai.reasoning import pick_reasoning, starts_in_reasoning
from worker.openai.tools.constraints import tool_constraint
from worker.openai.tools.definitions import ToolChoice, check_tools
from worker.openai.tools.events import ContentDelta, ToolCallArguments, ToolCallStarted, fold_calls, fold_text
from worker.openai.tools.qwen3_coder import Qwen3CoderParser
from worker.openai.tools.registry import PARSERS, pick_format

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "hourly": {"type": "boolean"},
                "ratio": {"type": "number"},
                "at": {"type": "object"},
                "tags": {"type": "array"},
                "note": {"type": ["string", "null"]},
            },
            "required": ["city"],
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


def block(name: str, **values: str) -> str:
    """A call as Qwen3.5's template writes one."""
    parameters = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"


# (answer, expected content, expected [(name, arguments)])
CASES = [
    (block("get_weather", city="Paris", days="3"), None, [("get_weather", {"city": "Paris", "days": 3})]),
    # Typed values: integer, boolean (Python's spelling too), number, object, array, a nullable string; a string
    # keeps digits, quotes, braces, markup and inner newlines as written.
    (
        block(
            "get_weather",
            city='12 "rue" {x} <b>\nline two',
            days="-4",
            hourly="True",
            ratio="0.5",
            at='{"lat": 48.8, "lon": 2.3}',
            tags="['a', 'b']",
            note="null",
        ),
        None,
        [
            (
                "get_weather",
                {
                    "city": '12 "rue" {x} <b>\nline two',
                    "days": -4,
                    "hourly": True,
                    "ratio": 0.5,
                    "at": {"lat": 48.8, "lon": 2.3},
                    "tags": ["a", "b"],
                    "note": None,
                },
            )
        ],
    ),
    # Content before the calls; several calls; text after them is no part of the answer.
    (
        "Let me check both.\n\n" + block("get_weather", city="Paris") + "\n" + block("get_time", tz="CET") + "\nDone.",
        "Let me check both.",
        [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})],
    ),
    # A function no tool names, and a parameter no schema lists: the values stay text.
    (block("search", query="cats", limit="5"), None, [("search", {"query": "cats", "limit": "5"})]),
    # A value that is not of its type: kept as written (a number where an integer was asked for, a word).
    (
        block("get_weather", city="Rome", days="2.5", hourly="maybe"),
        None,
        [("get_weather", {"city": "Rome", "days": 2.5, "hourly": "maybe"})],
    ),
    # An enum's value is the listed one, less the whitespace the grammar allows around it.
    (block("get_time", tz="\n CET\n"), None, [("get_time", {"tz": "CET"})]),
    # No parameters; a missing </parameter> and </function> are forgiven; one blank line kept of two.
    ("<tool_call>\n<function=get_time>\n</function>\n</tool_call>", None, [("get_time", {})]),
    (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n\n</tool_call>",
        None,
        [("get_weather", {"city": "Oslo\n"})],
    ),
    # Markup that is no call is content; so is an unfinished opener.
    ("<tool_call>\nnot a call\n</tool_call> and more", "<tool_call>\nnot a call\n</tool_call> and more", []),
    (
        "<tool_call>\n<function=bad name!>\n</function>\n</tool_call>",
        "<tool_call>\n<function=bad name!>\n</function>\n</tool_call>",
        [],
    ),
    ("2 < 3, <b>bold</b> and <tool_ca", "2 < 3, <b>bold</b> and <tool_ca", []),
    # Cut short: the call keeps what it had, as a whole object.
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", None, [("get_weather", {"city": "Par"})]),
    ("<tool_call>\n<function=get_weather>\n<parameter=days>\n12", None, [("get_weather", {"days": 12})]),
    (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</param",
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    ("Hm. <tool_call>\n<function=get_weather>\n<param", "Hm.", [("get_weather", {})]),
]


def _stream(parser: Qwen3CoderParser, pieces: list[str]) -> list:
    events = []
    for piece in pieces:
        events += parser.push(piece)
    return events + parser.finish()


@pytest.mark.parametrize("text,content,calls", CASES)
def test_whole_answers_parse_into_content_and_typed_calls(text, content, calls) -> None:
    parsed_content, parsed = Qwen3CoderParser.parse(text, schemas=SCHEMAS)
    assert parsed_content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls
    assert len({c.id for c in parsed}) == len(parsed) and all(c.id.startswith("call_") for c in parsed)


@pytest.mark.parametrize("text,content,calls", CASES)
def test_streamed_at_every_split_the_deltas_join_into_the_whole_answer(text, content, calls) -> None:
    whole_content, whole_calls = Qwen3CoderParser.parse(text, schemas=SCHEMAS)
    whole = (whole_content, [(c.name, c.arguments) for c in whole_calls])
    for pieces in [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]:
        events = _stream(Qwen3CoderParser(schemas=SCHEMAS), pieces)
        got_calls, got_content = fold_calls(events), fold_text(events, ContentDelta)
        assert (
            (got_content or None) if got_calls else got_content,
            [(c.name, c.arguments) for c in got_calls],
        ) == whole, pieces
        if calls:
            assert not any(m in got_content for m in ("<tool_call>", "<function=", "<parameter=", "</"))
        opened: set[int] = set()
        for event in events:
            if isinstance(event, ToolCallStarted):
                assert event.index not in opened and event.name
                opened.add(event.index)
            elif isinstance(event, ToolCallArguments):
                assert event.index in opened


def test_a_string_streams_as_it_is_written_and_other_values_at_their_end() -> None:
    text = block("get_weather", city="a long city name", days="12")
    parser = Qwen3CoderParser(schemas=SCHEMAS)
    events = [e for ch in text for e in parser.push(ch)] + parser.finish()
    assert isinstance(events[0], ToolCallStarted) and events[0].name == "get_weather"
    fragments = [e.fragment for e in events if isinstance(e, ToolCallArguments)]
    assert "".join(fragments) == '{"city": "a long city name", "days": 12}'
    assert len(fragments) > len("a long city name") and "12" in fragments  # the integer comes whole


def test_parallel_false_repeats_and_max_calls_end_the_answer() -> None:
    paris, rome = block("get_weather", city="Paris"), block("get_weather", city="Rome")
    assert [json.loads(c.arguments) for c in Qwen3CoderParser.parse(f"{paris}\n{rome}", parallel=False)[1]] == [
        {"city": "Paris"}
    ]
    # The small model's loop: the same call again ends the answer, and the repeat is never streamed.
    parser = Qwen3CoderParser(schemas=SCHEMAS)
    events = _stream(parser, list(f"{paris}\n{rome}\n{paris}\n{rome}"))
    assert parser.done and [json.loads(c.arguments) for c in fold_calls(events)] == [
        {"city": "Paris"},
        {"city": "Rome"},
    ]
    assert [c.name for c in Qwen3CoderParser.parse(f"{paris}\n{rome}", max_calls=1)[1]] == ["get_weather"]


def test_the_qwen35_template_picks_the_parser_and_renders_tools_and_a_second_turn(tokenizer) -> None:
    assert pick_format(QWEN35, "qwen3_5") == "qwen3_coder" and pick_format(QWEN35, "qwen3") == "qwen3_coder"
    assert pick_format(QWEN3, "qwen3") == "hermes"  # Qwen3's JSON calls stay hermes
    assert pick_format("{% for t in tools %}{{ t | tojson }}{% endfor %}", "qwen3_5_moe") == "qwen3_coder"
    assert pick_format(QWEN35, "qwen3_5", "hermes") == "hermes" and PARSERS["qwen3_coder"] is Qwen3CoderParser
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris for 3 days?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_0123456789abcdef01234567",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "days": 3, "at": {"lat": 48.8}}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_0123456789abcdef01234567", "content": "21 C"},
    ]
    from worker.openai.tools.plan import ToolPlan

    request = ChatCompletionRequest.model_validate({"model": "m", "messages": history, "tools": [WEATHER]})
    plan = ToolPlan("qwen3_coder", check_tools([WEATHER]), ToolChoice("auto"))
    shown, tools = plan.template_inputs(template_messages(request.messages))
    text = render_chat(tokenizer, shown, chat_template=QWEN35, tools=tools).text
    assert text.startswith(
        "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
        + json.dumps(WEATHER)
        + "\n</tools>"
    )
    assert "<function=example_function_name>" in text and "</IMPORTANT>\n\nBe brief.<|im_end|>" in text
    assert (
        "<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
        'Paris\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=at>\n{"lat": 48.8}\n</parameter>\n'
        "</function>\n</tool_call><|im_end|>\n"
    ) in text
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\n21 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    # The generation prompt opens the reasoning: qwen3's parser reads it from the answer's start.
    assert pick_reasoning(QWEN35, None) == "qwen3" and starts_in_reasoning("qwen3", text)
    off = render_chat(
        tokenizer, shown, chat_template=QWEN35, tools=tools, template_kwargs={"enable_thinking": False}
    ).text
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and not starts_in_reasoning("qwen3", off)


W, T = block("get_weather", city="Paris", days="3"), block("get_time", tz="CET")
GRAMMAR_CASES = [
    # (mode, named, parallel, text, accepted)
    ("required", None, True, W, True),
    ("required", None, True, f"{W}\n{T}", True),
    ("required", None, True, block("get_weather", city="Paris\non two lines", hourly="false", at='{"a": [1]}'), True),
    ("required", None, True, "Sure! " + W, False),  # calls only
    ("required", None, False, f"{W}\n{T}", False),  # one call
    ("required", None, True, block("get_weather", days="3"), False),  # city is required
    ("required", None, True, block("get_weather", city="Paris", days="three"), False),  # an integer
    ("required", None, True, block("get_weather", city="Paris", wind="5"), False),  # no other parameters
    ("required", None, True, block("get_time", tz="PST"), False),  # enum
    ("required", None, True, block("get_time", tz="\n  CET \n"), True),
    ("required", None, True, block("get_other", x="1"), False),  # not a tool
    ("required", None, True, W.replace("</function>\n", ""), False),  # malformed: no </function>
    ("required", None, True, W.replace("<parameter=days>\n3\n</parameter>\n", "<parameter=days>\n3\n"), False),
    ("required", None, True, '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>', False),
    ("named", "get_time", True, T, True),
    ("named", "get_time", True, W, False),
    ("named", "get_time", True, f"{T}\n{T}", False),
    ("auto", None, True, "Just an answer.", True),
    ("auto", None, True, f"Let me check.\n\n{W}\n{T}", True),
    ("auto", None, True, f"Let me check. {W} and more text", False),
]


@pytest.mark.parametrize("mode,named,parallel,text,accepted", GRAMMAR_CASES)
def test_the_forced_call_grammar_and_the_parser_agree(
    grammars, tokenizer, mode, named, parallel, text, accepted
) -> None:
    import xgrammar as xgr

    from worker.openai.tools.plan import ToolPlan

    plan = ToolPlan("qwen3_coder", check_tools([WEATHER, TIME]), ToolChoice(mode, named), parallel)
    matcher = xgr.GrammarMatcher(grammars.get(tool_constraint(plan, "")))
    assert (matcher.accept_string(text) and matcher.accept_token(tokenizer.eos_token_id)) is accepted
    if accepted:
        for call in Qwen3CoderParser.parse(text, parallel, schemas=plan.schemas)[1]:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_reasoning_may_come_first(grammars, tokenizer) -> None:
    import xgrammar as xgr

    from worker.openai.tools.plan import ToolPlan

    plan = ToolPlan("qwen3_coder", check_tools([WEATHER, TIME]), ToolChoice("required"))
    matcher = xgr.GrammarMatcher(grammars.get(tool_constraint(plan, "", "qwen3", in_reasoning=True)))
    assert matcher.accept_string(f"The user wants Paris.\n</think>\n\n{W}") and matcher.accept_token(
        tokenizer.eos_token_id
    )
