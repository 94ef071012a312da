"""Seed-OSS's tool calls (`seed_oss`: Qwen3-Coder's `<function=...>` / `<parameter=...>` inside `<seed:tool_call>`)
and reasoning (`<seed:think>`): the parser whole, streamed one character at a time and at every split, all equal;
`auto` picks both from the chat template; the grammar that holds forced calls agrees with the parser."""

from __future__ import annotations

import json

import jsonschema
import pytest

from worker.openai.reasoning import ReasoningParser, pick_reasoning, starts_in_reasoning
from worker.openai.tools.constraints import tool_constraint
from worker.openai.tools.definitions import ToolChoice, check_tools
from worker.openai.tools.events import ContentDelta, fold_calls, fold_text
from worker.openai.tools.plan import ToolPlan
from worker.openai.tools.qwen3_coder import Qwen3CoderParser, SeedOssParser
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
# What Seed-OSS's template shows the model: its own tags around Qwen3-Coder's function markup.
TEMPLATE = (
    "{% if tools %}<seed:bos>system\nYou may call: {{ tools | tojson }}\n<seed:tool_call>\n<function=NAME>\n"
    "<parameter=KEY>VALUE</parameter>\n</function>\n</seed:tool_call><seed:eos>{% endif %}"
    "{% for m in messages %}<seed:bos>{{ m.role }}\n{{ m.content }}<seed:eos>{% endfor %}"
    "<seed:bos>assistant\n<seed:think>"
)


def seed(name: str, **values: str) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    return f"<seed:tool_call>\n<function={name}>\n{params}</function>\n</seed:tool_call>"


CASES = [
    (
        "Let me look.\n" + seed("get_weather", city="Paris", days="3"),
        "Let me look.",
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    (
        seed("get_weather", city="Rome") + seed("get_weather", city="Oslo"),
        None,
        [("get_weather", {"city": "Rome"}), ("get_weather", {"city": "Oslo"})],
    ),
    (
        "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>",
        [],
    ),
    ("No call here.", "No call here.", []),
]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_whole_and_streamed_answers_agree(text, content, calls) -> None:
    got_content, got = SeedOssParser.parse(text, schemas=SCHEMAS)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    whole = (got_content, [(c.name, c.arguments) for c in got])
    for pieces in [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]:
        parser = SeedOssParser(schemas=SCHEMAS)
        events = [e for piece in pieces for e in parser.push(piece)] + parser.finish()
        seen, text_seen = fold_calls(events), fold_text(events, ContentDelta)
        assert ((text_seen or None) if seen else text_seen, [(c.name, c.arguments) for c in seen]) == whole
        assert "<seed:" not in text_seen or not calls


def test_auto_picks_the_call_and_reasoning_formats_from_the_template() -> None:
    assert pick_format(TEMPLATE, "seed_oss") == "seed_oss" and PARSERS["seed_oss"] is SeedOssParser
    assert pick_format("{% for t in tools %}{{ t | tojson }}{% endfor %}", "seed_oss") == "seed_oss"
    assert pick_format("<tool_call>\n<function=x>\n<parameter=y>", None) == "qwen3_coder"
    assert PARSERS["qwen3_coder"] is Qwen3CoderParser
    assert pick_reasoning(TEMPLATE, None) == "seed_oss"
    assert starts_in_reasoning("seed_oss", "<seed:bos>assistant\n<seed:think>")


def test_reasoning_splits_at_the_seed_think_tags() -> None:
    text = "<seed:think>Paris is in France.</seed:think>It is sunny."
    parser = ReasoningParser(in_reasoning=False, kind="seed_oss")
    pieces = [p for c in text for p in parser.push(c)] + parser.finish()
    reasoning = "".join(p.text for p in pieces if p.part == "reasoning")
    content = "".join(p.text for p in pieces if p.part == "content")
    assert (reasoning, content) == ("Paris is in France.", "It is sunny.")


@pytest.mark.parametrize(
    "mode,text,accepted",
    [
        ("required", seed("get_weather", city="Paris", days="3"), True),
        ("required", seed("get_weather", days="3"), False),  # city is required
        ("required", "Sure! " + seed("get_weather", city="Paris"), False),
        ("auto", "Just an answer.", True),
        ("auto", "Let me check.\n" + seed("get_weather", city="Paris"), True),
    ],
)
def test_the_forced_call_grammar_and_the_parser_agree(grammars, tokenizer, mode, text, accepted) -> None:
    import xgrammar as xgr

    plan = ToolPlan("seed_oss", check_tools([WEATHER]), ToolChoice(mode, None), True)
    matcher = xgr.GrammarMatcher(grammars.get(tool_constraint(plan, "")))
    assert (matcher.accept_string(text) and matcher.accept_token(tokenizer.eos_token_id)) is accepted
    if accepted:
        for call in SeedOssParser.parse(text, schemas=plan.schemas)[1]:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
