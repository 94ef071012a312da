"""The grammars behind forced and "auto" tool calls, compiled by the engine's grammar cache for the default
model's vocabulary: answers in each format are accepted (and may end) exactly when they are calls the format's
parser reads as valid, with arguments held to the schema."""

from __future__ import annotations

import json

import pytest

from worker.openai.errors import BadRequest
from worker.openai.tools.constraints import tool_constraint
from worker.openai.tools.definitions import ToolChoice, check_tools
from worker.openai.tools.plan import ToolPlan
from worker.openai.tools.registry import PARSERS

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["tz"],
        },
    },
}
TOOLS = check_tools([WEATHER, TIME])
W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
T = '{"name": "get_time", "arguments": {"tz": "CET"}}'
H_W, H_T = f"<tool_call>\n{W}\n</tool_call>", f"<tool_call>\n{T}\n</tool_call>"
L_W, L_T = W.replace("arguments", "parameters"), T.replace("arguments", "parameters")
G_W = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
G_T = '<|tool_call>call:get_time{tz:<|"|>CET<|"|>}<tool_call|>'


def _matches(grammars, tokenizer, spec, text: str) -> bool:
    """Whether the grammar takes `text` and then lets the answer end."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(grammars.get(spec))
    return matcher.accept_string(text) and matcher.accept_token(tokenizer.eos_token_id)


CASES = [
    # (format, mode, named, parallel, template, text, accepted)
    ("generic", "required", None, True, "", H_W, True),
    ("generic", "required", None, True, "", f"{H_W}\n{H_T}", True),
    ("generic", "required", None, True, "", "Sure! " + H_W, False),  # calls only
    ("generic", "required", None, False, "", f"{H_W}\n{H_T}", False),  # one call
    ("generic", "required", None, True, "", H_W.replace("Paris", 'Paris", "x": "1'), False),  # schema
    ("generic", "required", None, True, "", H_T.replace("CET", "PST"), False),  # enum
    ("generic", "named", "get_time", True, "", H_T, True),
    ("generic", "named", "get_time", True, "", H_W, False),
    ("generic", "named", "get_time", True, "", f"{H_T}\n{H_T}", False),
    ("generic", "auto", None, True, "", "Just an answer.", True),
    ("generic", "auto", None, True, "", f"Let me check. {H_W}\n{H_T}", True),
    ("generic", "auto", None, True, "", f"Let me check. {H_W} and more text", False),
    ("generic", "auto", None, False, "", f"{H_W}\n{H_T}", False),
    ("generic", "auto", None, True, "", '<tool_call>\n{"name": "other", "arguments": {}}\n</tool_call>', False),
    ("llama3_json", "required", None, True, "", f"{L_W}; {L_T}", True),
    ("llama3_json", "auto", None, True, "", f"Checking. {L_W}", True),
    ("mistral", "required", None, True, "", f"[TOOL_CALLS] [{W}, {T}]", True),
    ("mistral", "required", None, True, "[ARGS]", '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}', True),
    ("mistral", "auto", None, True, "", f"Hm [TOOL_CALLS] [{T}]", True),  # constrained: get_time is strict
    # Gemma 4: its own argument syntax, no whitespace, calls in a row.
    ("gemma4", "required", None, True, "", G_W, True),
    ("gemma4", "required", None, True, "", G_W + G_T, True),
    ("gemma4", "required", None, True, "", "Sure! " + G_W, False),
    ("gemma4", "required", None, False, "", G_W + G_T, False),
    ("gemma4", "required", None, True, "", G_W.replace('<|"|>}', '<|"|>,x:1}'), False),  # schema: no other keys
    ("gemma4", "required", None, True, "", G_T.replace("CET", "PST"), False),  # enum
    ("gemma4", "required", None, True, "", G_W.replace("city:", "city: "), False),  # no whitespace
    ("gemma4", "required", None, True, "", '<|tool_call>call:get_weather{city:<|"|>a<|b<|"|>}<tool_call|>', False),
    ("gemma4", "named", "get_time", True, "", G_T, True),
    ("gemma4", "named", "get_time", True, "", G_W, False),
    ("gemma4", "auto", None, True, "", "Just an answer.", True),
    ("gemma4", "auto", None, True, "", f"Let me check. {G_W}{G_T}", True),  # constrained: get_time is strict
    ("gemma4", "auto", None, True, "", f"Let me check. {G_W} and more text", False),
]


@pytest.mark.parametrize("fmt,mode,named,parallel,template,text,accepted", CASES)
def test_grammar_and_parser_agree(grammars, tokenizer, fmt, mode, named, parallel, template, text, accepted) -> None:
    plan = ToolPlan(fmt, TOOLS, ToolChoice(mode, named), parallel)
    spec = tool_constraint(plan, template)
    assert _matches(grammars, tokenizer, spec, text) is accepted
    if accepted:
        _, calls = PARSERS[fmt].parse(text, parallel)
        for call in calls:
            assert call.name in ("get_weather", "get_time") and json.loads(call.arguments)


def test_reasoning_may_come_first_and_none_leaves_decoding_free(grammars, tokenizer) -> None:
    plan = ToolPlan("hermes", TOOLS, ToolChoice("required"))
    assert _matches(grammars, tokenizer, tool_constraint(plan, "", "qwen3"), f"<think>\nHm.\n</think>\n\n{H_W}")
    assert _matches(
        grammars, tokenizer, tool_constraint(plan, "", "qwen3", in_reasoning=True), f"Hm.\n</think>\n\n{H_W}"
    )
    assert tool_constraint(ToolPlan("hermes", TOOLS, ToolChoice("none")), "") is None
    loose = ToolPlan("mistral", check_tools([WEATHER]), ToolChoice("auto"))
    assert tool_constraint(loose, "") is None  # [TOOL_CALLS] is a special token the grammar cannot offer


def test_a_schema_the_grammar_cannot_enforce(grammars, tokenizer) -> None:
    odd = {"type": "object", "properties": {"a": {"type": "string"}}, "patternProperties": {"^x": {}}}
    loose = check_tools([{"type": "function", "function": {"name": "f", "parameters": odd}}])
    spec = tool_constraint(ToolPlan("generic", loose, ToolChoice("required")), "")
    assert _matches(grammars, tokenizer, spec, '<tool_call>\n{"name": "f", "arguments": {"z": 1}}\n</tool_call>')
    strict = check_tools([WEATHER, {"type": "function", "function": {"name": "f", "strict": True, "parameters": odd}}])
    with pytest.raises(BadRequest) as info:
        tool_constraint(ToolPlan("generic", strict, ToolChoice("required")), "")
    assert info.value.param == "tools[1].function.parameters"


def test_string_lengths_are_enforced(grammars, tokenizer) -> None:
    short = check_tools(
        [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "parameters": {
                        "type": "object",
                        "properties": {"code": {"type": "string", "minLength": 2, "maxLength": 4}},
                        "required": ["code"],
                    },
                },
            }
        ]
    )
    spec = tool_constraint(ToolPlan("generic", short, ToolChoice("required")), "")
    call = '<tool_call>\n{{"name": "f", "arguments": {{"code": "{}"}}}}\n</tool_call>'
    assert _matches(grammars, tokenizer, spec, call.format("abcd"))
    assert not _matches(grammars, tokenizer, spec, call.format("abcde"))
    assert not _matches(grammars, tokenizer, spec, call.format("a"))


def test_gemma4_reasoning_first_and_schemas_its_grammar_cannot_enforce(grammars, tokenizer) -> None:
    plan = ToolPlan("gemma4", TOOLS, ToolChoice("required"))
    assert _matches(grammars, tokenizer, tool_constraint(plan, "", "gemma4"), f"<|channel>thought\nHm.<channel|>{G_W}")
    assert not _matches(grammars, tokenizer, tool_constraint(plan, "", "gemma4"), f"<think>Hm.</think>{G_W}")
    nested = {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
            "at": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]},
        },
        "required": ["at"],
    }
    spec = tool_constraint(
        ToolPlan(
            "gemma4",
            check_tools([{"type": "function", "function": {"name": "f", "parameters": nested}}]),
            ToolChoice("required"),
        ),
        "",
    )
    call = "<|tool_call>call:f{{{}}}<tool_call|>"
    assert _matches(grammars, tokenizer, spec, call.format('at:{lat:-1.5e3},tags:[<|"|>a<|"|>,<|"|>b<|"|>]'))
    assert not _matches(grammars, tokenizer, spec, call.format('tags:[<|"|>a<|"|>]'))  # "at" is required
    assert not _matches(grammars, tokenizer, spec, call.format('at:{lat:1},tags:[<|"|>a<|"|>,<|"|>b<|"|>,<|"|>c<|"|>]'))
    # A keyword the grammar cannot hold to: any object for a plain tool, a 400 naming it for a strict one.
    odd = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^x"}}}
    loose = check_tools([{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/x"}}}])
    spec = tool_constraint(ToolPlan("gemma4", loose, ToolChoice("required")), "")
    assert _matches(grammars, tokenizer, spec, call.format("z:1"))
    strict = check_tools([WEATHER, {"type": "function", "function": {"name": "f", "strict": True, "parameters": odd}}])
    with pytest.raises(BadRequest) as info:
        tool_constraint(ToolPlan("gemma4", strict, ToolChoice("required")), "")
    assert info.value.param == "tools[1].function.parameters" and "pattern" in info.value.message
