"""Granite 3.x's (`granite`: a JSON list of calls after `<|tool_call|>` or `<tool_call>`) and Phi-4-mini's
(`phi4_mini_json`: the list after `functools`) tool calls: each parser whole, streamed one character at a time and at
every split, all equal; `auto` picks them from the chat template or the family; the grammar that holds forced calls
agrees with the parser."""

from __future__ import annotations

import json

import jsonschema
import pytest
from family_templates import QWEN25

from worker.openai.tools.constraints import tool_constraint
from worker.openai.tools.definitions import ToolChoice, check_tools
from worker.openai.tools.events import ContentDelta, fold_calls, fold_text
from worker.openai.tools.mistral import GraniteParser, Phi4MiniParser
from worker.openai.tools.plan import ToolPlan
from worker.openai.tools.registry import PARSERS, pick_format

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"]}
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
ROME = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
CASES = [
    (GraniteParser, f"<|tool_call|>[{PARIS}]", None, [{"city": "Paris", "days": 3}]),
    (
        GraniteParser,
        f"Let me check. <tool_call>[{PARIS}, {ROME}]",
        "Let me check.",
        [{"city": "Paris", "days": 3}, {"city": "Rome"}],
    ),
    (GraniteParser, "<tool_call> no list", "<tool_call> no list", []),
    (GraniteParser, "Just text.", "Just text.", []),
    (Phi4MiniParser, f"functools[{PARIS}]", None, [{"city": "Paris", "days": 3}]),
    (Phi4MiniParser, f"functools[{PARIS},{ROME}]", None, [{"city": "Paris", "days": 3}, {"city": "Rome"}]),
    (Phi4MiniParser, "Use functools wisely.", "Use functools wisely.", []),
]


@pytest.mark.parametrize("cls,text,content,calls", CASES)
def test_whole_and_streamed_answers_agree(cls, text, content, calls) -> None:
    got_content, got = cls.parse(text, schemas=SCHEMAS)
    assert got_content == content
    assert [json.loads(c.arguments) for c in got] == calls and all(c.name == "get_weather" for c in got)
    whole = (got_content, [(c.name, c.arguments) for c in got])
    for pieces in [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]:
        parser = cls(schemas=SCHEMAS)
        events = [e for piece in pieces for e in parser.push(piece)] + parser.finish()
        seen, text_seen = fold_calls(events), fold_text(events, ContentDelta)
        assert ((text_seen or None) if seen else text_seen, [(c.name, c.arguments) for c in seen]) == whole, pieces


def test_auto_picks_them_from_the_template_or_the_family() -> None:
    assert PARSERS["granite"] is GraniteParser and PARSERS["phi4_mini_json"] is Phi4MiniParser
    granite30 = "{% if tools %}<|start_of_role|>tools<|end_of_role|>{{ tools | tojson }}{% endif %}<|tool_call|>"
    assert pick_format(granite30, None) == "granite"
    granite31 = "{% if tools %}{{ tools | tojson }} Write <tool_call> and a list of calls.{% endif %}"
    assert pick_format(granite31, "granite") == "granite" and pick_format(granite31, "qwen2") == "hermes"
    phi4_mini = "{% if m.tools %}<|system|>{{ m.content }}<|tool|>{{ m.tools }}<|/tool|><|end|>{% endif %}"
    assert pick_format(phi4_mini, "phi3") == "phi4_mini_json"
    assert pick_format(QWEN25, "qwen2") == "hermes"  # the others keep theirs


def test_granite_4_h_calls_read_as_hermes() -> None:
    """Granite 4.0-H's template asks for one JSON object in each <tool_call></tool_call> (Hermes'), not Granite 3's
    list: auto picks hermes for its model_type, and that parser reads both of two calls."""
    granite4 = (
        "{% if tools %}You are provided with function signatures within <tools></tools> XML tags:\n<tools>{{ tools }}"
        "</tools>\n\nFor each tool call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{}\n</tool_call>{% endif %}"
    )
    assert pick_format(granite4, "granitemoehybrid") == "hermes"
    text = f"<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>\n{ROME}\n</tool_call>"
    content, calls = PARSERS["hermes"].parse(text, schemas=SCHEMAS)
    assert not content and [json.loads(c.arguments) for c in calls] == [{"city": "Paris", "days": 3}, {"city": "Rome"}]


@pytest.mark.parametrize(
    "fmt,template,mode,text,accepted",
    [
        ("granite", "", "required", f"<tool_call>[{PARIS}]", True),
        ("granite", "<|tool_call|>", "required", f"<|tool_call|>[{PARIS}, {ROME}]", True),
        ("granite", "", "required", '<tool_call>[{"name": "get_weather", "arguments": {"days": 3}}]', False),
        ("granite", "", "auto", "No call needed.", True),
        ("phi4_mini_json", "", "required", f"functools[{PARIS}]", True),
        ("phi4_mini_json", "", "required", f"Sure. functools[{PARIS}]", False),
    ],
)
def test_the_forced_call_grammar_and_the_parser_agree(grammars, tokenizer, fmt, template, mode, text, accepted) -> None:
    import xgrammar as xgr

    plan = ToolPlan(fmt, check_tools([WEATHER]), ToolChoice(mode, None), True)
    matcher = xgr.GrammarMatcher(grammars.get(tool_constraint(plan, template)))
    assert (matcher.accept_string(text) and matcher.accept_token(tokenizer.eos_token_id)) is accepted
    if accepted:
        for call in PARSERS[fmt].parse(text, schemas=plan.schemas)[1]:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
