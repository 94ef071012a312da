"""The grammars behind forced and "auto" tool calls, compiled by the engine's grammar cache for the default
model's vocabulary: answers in each format are accepted (and may end) exactly when they are calls the format's
parser reads as valid, with arguments held to the schema."""

from __future__ import annotations

import json

import pytest

from engine.sample.structured.compiler import GrammarCache
from worker.openai.errors import BadRequest
from worker.openai.tools.constraints import tool_constraint
from worker.openai.tools.definitions import ToolChoice, check_tools
from worker.openai.tools.plan import ToolPlan
from worker.openai.tools.registry import PARSERS

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"]}}}
TOOLS = check_tools([WEATHER, TIME])
W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
T = '{"name": "get_time", "arguments": {"tz": "CET"}}'
H_W, H_T = f"<tool_call>\n{W}\n</tool_call>", f"<tool_call>\n{T}\n</tool_call>"
L_W, L_T = W.replace("arguments", "parameters"), T.replace("arguments", "parameters")


@pytest.fixture(scope="module")
def grammars(tokenizer):
    cache = GrammarCache(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    yield cache
    cache.shutdown()


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
    ("generic", "required", None, True, "", H_W.replace("Paris", "Paris\", \"x\": \"1"), False),  # schema
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
    assert _matches(grammars, tokenizer, tool_constraint(plan, "", "qwen3", in_reasoning=True),
                    f"Hm.\n</think>\n\n{H_W}")
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
    short = check_tools([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"code": {"type": "string", "minLength": 2, "maxLength": 4}},
        "required": ["code"]}}}])
    spec = tool_constraint(ToolPlan("generic", short, ToolChoice("required")), "")
    call = '<tool_call>\n{{"name": "f", "arguments": {{"code": "{}"}}}}\n</tool_call>'
    assert _matches(grammars, tokenizer, spec, call.format("abcd"))
    assert not _matches(grammars, tokenizer, spec, call.format("abcde"))
    assert not _matches(grammars, tokenizer, spec, call.format("a"))
