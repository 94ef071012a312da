"""GLM-4.5/4.6/4.7's (`glm45`) and DeepSeek V3/R1/V3.1's (`deepseek_v3`, `deepseek_v31`) tool calls: each parser
whole, streamed one character at a time, at every split and in random chunks, all equal; `auto` picks them from the
chat template; their reasoning split; the grammar that holds forced calls agrees with the parser."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from family_templates import DEEPSEEK_R1, DEEPSEEK_V31, GEMMA4, GLM45, LLAMA31, MISTRAL_V3, QWEN3, QWEN25, QWEN35

from worker.openai.chat_template import render_chat, template_messages
from worker.openai.reasoning import pick_reasoning, reasoning_first, starts_in_reasoning
from worker.openai.tools.constraints import tool_constraint
from worker.openai.tools.deepseek import DeepSeekV3Parser, DeepSeekV31Parser
from worker.openai.tools.definitions import ToolChoice, check_tools
from worker.openai.tools.events import ContentDelta, ToolCallArguments, ToolCallStarted, fold_calls, fold_text
from worker.openai.tools.glm4_moe import Glm4MoeParser
from worker.openai.tools.parser import ToolParser
from worker.openai.tools.plan import ToolPlan
from worker.openai.tools.registry import PARSERS, pick_format

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "at": {"type": "object"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}},
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
NESTED = {"lat": 48.8, "tags": ["a", {"b": None}], "q": 'say "hi" {x}'}


def glm(name: str, newlines: bool = True, **values: str) -> str:
    """A call as GLM-4.5's template writes one (GLM-4.7's without the newlines)."""
    nl = "\n" if newlines else ""
    pairs = "".join(f"<arg_key>{k}</arg_key>{nl}<arg_value>{v}</arg_value>{nl}" for k, v in values.items())
    return f"<tool_call>{name}{nl}{pairs}</tool_call>"


def v3(*calls: tuple[str, str]) -> str:
    """Calls as DeepSeek V3's and R1's templates write them."""
    body = "\n".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{a}\n```<｜tool▁call▁end｜>" for n, a in calls
    )
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def v31(*calls: tuple[str, str]) -> str:
    """Calls as DeepSeek V3.1's template writes them."""
    body = "".join(f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{a}<｜tool▁call▁end｜>" for n, a in calls)
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


NESTED_TEXT = json.dumps(NESTED, ensure_ascii=False)
# (parser, answer, expected content, expected [(name, arguments object)])
CASES: list[tuple[type[ToolParser], str, str | None, list]] = [
    (Glm4MoeParser, glm("get_weather", city="Paris", days="3"), None, [("get_weather", {"city": "Paris", "days": 3})]),
    # Several calls after text; a string stays a string even when it reads as JSON; values of parameters no schema
    # lists are JSON when they read as JSON (nested objects included), else text.
    (
        Glm4MoeParser,
        "Let me check both.\n"
        + glm("get_weather", city="12", at=NESTED_TEXT)
        + "\n"
        + glm("search", query="cats and dogs", limit="5", filters=NESTED_TEXT, flag="true")
        + "\nDone.",
        "Let me check both.",
        [
            ("get_weather", {"city": "12", "at": NESTED}),
            ("search", {"query": "cats and dogs", "limit": 5, "filters": NESTED, "flag": True}),
        ],
    ),
    # GLM-4.7: no newlines; a call without arguments; an enum.
    (
        Glm4MoeParser,
        glm("get_weather", False, city="Rome\nand more", days="2") + glm("get_time", False) + glm("get_time", tz="CET"),
        None,
        [("get_weather", {"city": "Rome\nand more", "days": 2}), ("get_time", {}), ("get_time", {"tz": "CET"})],
    ),
    # Malformed: no name, a hermes-style body, an unfinished opener are content; a call cut short keeps what it had.
    (Glm4MoeParser, "<tool_call>\n</tool_call> ok", "<tool_call>\n</tool_call> ok", []),
    (
        Glm4MoeParser,
        '<tool_call>{"name": "x"}</tool_call>',
        '<tool_call>{"name": "x"}</tool_call>',
        [],
    ),
    (Glm4MoeParser, "a <b> and <tool_ca", "a <b> and <tool_ca", []),
    (
        Glm4MoeParser,
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par",
        None,
        [("get_weather", {"city": "Par"})],
    ),
    (
        Glm4MoeParser,
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</tool_call>",
        None,
        [("get_weather", {"city": "Oslo"})],
    ),
    (DeepSeekV3Parser, v3(("get_weather", '{"city": "Paris"}')), None, [("get_weather", {"city": "Paris"})]),
    (
        DeepSeekV3Parser,
        "Let me look.\n\n" + v3(("get_weather", '{"city": "Paris", "days": 3}'), ("search", NESTED_TEXT)),
        "Let me look.",
        [("get_weather", {"city": "Paris", "days": 3}), ("search", NESTED)],
    ),
    (
        DeepSeekV31Parser,
        v31(("get_weather", '{"city": "Paris", "at": ' + NESTED_TEXT + "}"), ("get_time", "{}")) + "\nafter",
        None,
        [("get_weather", {"city": "Paris", "at": NESTED}), ("get_time", {})],
    ),
    (DeepSeekV31Parser, v31(("get_time", "")), None, [("get_time", {})]),
    # A V3.1 call read by the V3 name (one parser reads both), and a call without the outer block.
    (DeepSeekV3Parser, v31(("get_time", '{"tz": "UTC"}')), None, [("get_time", {"tz": "UTC"})]),
    (
        DeepSeekV31Parser,
        "Hi <｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜>",
        "Hi",
        [("get_time", {})],
    ),
    # Malformed: markup that is no call is content; a cut-short call closes with what it had.
    (
        DeepSeekV3Parser,
        "<｜tool▁calls▁begin｜>nothing here<｜tool▁calls▁end｜>",
        "<｜tool▁calls▁begin｜>nothing here<｜tool▁calls▁end｜>",
        [],
    ),
    (
        DeepSeekV31Parser,
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>bad name!<｜tool▁sep｜>{}<｜tool▁call▁end｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>bad name!<｜tool▁sep｜>{}<｜tool▁call▁end｜>",
        [],
    ),
    (DeepSeekV3Parser, "x <｜tool▁calls▁beg", "x <｜tool▁calls▁beg", []),
    (
        DeepSeekV3Parser,
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```",
        None,
        [("get_time", {})],
    ),
]
MARKUP = ("<tool_call>", "<arg_", "</arg_", "</tool_call>", "｜tool", "```")


def _split(text: str, sizes: random.Random | None) -> list[str]:
    if sizes is None:
        return list(text)
    pieces, at = [], 0
    while at < len(text):
        n = sizes.randint(1, 7)
        pieces.append(text[at : at + n])
        at += n
    return pieces


def _read(parser: ToolParser, pieces: list[str]) -> list:
    events = []
    for piece in pieces:
        events += parser.push(piece)
    return events + parser.finish()


@pytest.mark.parametrize("cls,text,content,calls", CASES)
def test_whole_and_streamed_answers_agree(cls, text, content, calls) -> None:
    got_content, got = cls.parse(text, schemas=SCHEMAS)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    whole = (got_content, [(c.name, c.arguments) for c in got])
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [_split(text, None)]
    splits += [_split(text, random.Random(seed)) for seed in range(20)]
    for pieces in splits:
        events = _read(cls(schemas=SCHEMAS), pieces)
        calls_seen, text_seen = fold_calls(events), fold_text(events, ContentDelta)
        assert ((text_seen or None) if calls_seen else text_seen, [(c.name, c.arguments) for c in calls_seen]) == whole
        if calls:
            assert not any(m in text_seen for m in MARKUP), pieces
        opened: set[int] = set()
        for event in events:  # each call's name first, then its argument fragments
            if isinstance(event, ToolCallStarted):
                assert event.index not in opened and event.name
                opened.add(event.index)
            elif isinstance(event, ToolCallArguments):
                assert event.index in opened


def test_arguments_stream_in_fragments() -> None:
    for cls, text in (
        (Glm4MoeParser, glm("get_weather", city="a long city name", days="12")),
        (DeepSeekV31Parser, v31(("get_weather", '{"city": "a long city name", "days": 12}'))),
    ):
        parser = cls(schemas=SCHEMAS)
        events = _read(parser, list(text))
        assert isinstance(events[0], ToolCallStarted) and events[0].name == "get_weather"
        fragments = [e.fragment for e in events if isinstance(e, ToolCallArguments)]
        assert json.loads("".join(fragments)) == {"city": "a long city name", "days": 12}
        assert len(fragments) > len("a long city name")


def test_parallel_false_and_repeats_end_the_answer() -> None:
    paris, rome = glm("get_weather", city="Paris"), glm("get_weather", city="Rome")
    assert len(Glm4MoeParser.parse(paris + rome, parallel=False)[1]) == 1
    parser = Glm4MoeParser(schemas=SCHEMAS)
    events = _read(parser, list(paris + rome + paris))
    assert parser.done and len(fold_calls(events)) == 2
    text = v31(("get_time", "{}"), ("get_time", "{}"))
    assert len(DeepSeekV31Parser.parse(text)[1]) == 1


def test_auto_picks_the_formats_from_the_template() -> None:
    assert pick_format("{{ '<tool_call>' + name }}<arg_key>{{ k }}</arg_key>", None) == "glm45"
    assert pick_format(GLM45, "glm4_moe") == "glm45" and pick_format(GLM45, "glm4_moe_lite") == "glm45"
    v3_template = "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + t + '<｜tool▁sep｜>' + n + '\\n```json\\n'}}"
    assert pick_format(v3_template, "deepseek_v3") == "deepseek_v3"
    assert pick_format("{{'<｜tool▁calls▁begin｜>' + n + '<｜tool▁sep｜>'}}", None) == "deepseek_v31"
    assert pick_format(DEEPSEEK_V31, "deepseek_v3") == "deepseek_v31"
    assert pick_format("{% for t in tools %}{{ t | tojson }}{% endfor %}", "glm4_moe_lite") == "glm45"
    assert (
        PARSERS["glm45"] is Glm4MoeParser
        and issubclass(PARSERS["glm47"], Glm4MoeParser)
        and PARSERS["deepseek_v3"] is DeepSeekV3Parser
    )
    assert PARSERS["deepseek_v31"] is DeepSeekV31Parser and pick_format(GLM45, None, "hermes") == "hermes"
    # The templates that had a format keep it.
    assert pick_format(QWEN25, "qwen2") == "hermes" and pick_format(QWEN3, "qwen3") == "hermes"
    assert pick_format(QWEN35, "qwen3_5") == "qwen3_coder" and pick_format(LLAMA31, "llama") == "llama3_json"
    assert pick_format(MISTRAL_V3, "mistral") == "mistral" and pick_format(GEMMA4, None) == "gemma4"
    assert pick_format(DEEPSEEK_R1, "qwen2") == "generic"


def test_reasoning_of_both_families(tokenizer) -> None:
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    assert pick_reasoning(GLM45, None) == "qwen3" and pick_reasoning(DEEPSEEK_V31, None) == "deepseek_r1"
    on = render_chat(tokenizer, ask, chat_template=GLM45).text
    off = render_chat(tokenizer, ask, chat_template=GLM45, template_kwargs={"enable_thinking": False}).text
    assert on.endswith("<|assistant|>") and not starts_in_reasoning("qwen3", on)
    assert off.endswith("<think></think>") and reasoning_first("qwen3", off) is None
    on = render_chat(tokenizer, ask, chat_template=DEEPSEEK_V31, template_kwargs={"thinking": True}).text
    off = render_chat(tokenizer, ask, chat_template=DEEPSEEK_V31).text
    assert starts_in_reasoning("deepseek_r1", on) and not starts_in_reasoning("deepseek_r1", off)
    assert reasoning_first("deepseek_r1", off) is None


def test_the_glm_template_renders_tools_and_a_call_in_the_history(tokenizer) -> None:
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "at": {"lat": 48.8}}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_0", "content": "21 C"},
    ]
    plan = ToolPlan("glm45", check_tools([WEATHER]), ToolChoice("auto"))
    shown, tools = plan.template_inputs(template_messages(history))
    text = render_chat(tokenizer, shown, chat_template=GLM45, tools=tools).text
    written = glm("get_weather", city="Paris", at='{"lat": 48.8}')
    assert '"name": "get_weather"' in text and "\n" + written in text, text
    assert (
        Glm4MoeParser.parse(written, schemas=plan.schemas)[1][0].arguments == '{"city": "Paris", "at": {"lat": 48.8}}'
    )


W_GLM, T_GLM = glm("get_weather", city="Paris", days="3"), glm("get_time", tz="CET")
W_ARGS, T_ARGS = '{"city": "Paris", "days": 3}', '{"tz": "CET"}'
GRAMMAR_CASES = [
    # (format, mode, named, parallel, text, accepted)
    ("glm45", "required", None, True, W_GLM, True),
    ("glm45", "required", None, True, f"{W_GLM}\n{T_GLM}", True),
    ("glm45", "required", None, False, f"{W_GLM}\n{T_GLM}", False),
    ("glm45", "required", None, True, glm("get_weather", days="3"), False),  # city is required
    ("glm45", "required", None, True, glm("get_weather", city="Paris", days="x"), False),
    ("glm45", "required", None, True, "Sure! " + W_GLM, False),
    ("glm45", "required", None, True, glm("get_weather", False, city="Paris") + "\n" + glm("get_time", False), True),
    ("glm45", "named", "get_time", True, T_GLM, True),
    ("glm45", "named", "get_time", True, W_GLM, False),
    ("glm45", "auto", None, True, "Just an answer.", True),
    ("glm45", "auto", None, True, f"Let me check.\n{W_GLM}", True),
    ("deepseek_v3", "required", None, True, v3(("get_weather", W_ARGS), ("get_time", T_ARGS)), True),
    ("deepseek_v3", "required", None, False, v3(("get_weather", W_ARGS), ("get_time", T_ARGS)), False),
    ("deepseek_v3", "required", None, True, v3(("get_weather", '{"days": 3}')), False),
    ("deepseek_v3", "named", "get_time", True, v3(("get_time", T_ARGS)), True),
    ("deepseek_v3", "auto", None, True, "Hello." + v3(("get_time", T_ARGS)), True),
    ("deepseek_v31", "required", None, True, v31(("get_weather", W_ARGS), ("get_time", T_ARGS)), True),
    ("deepseek_v31", "required", None, True, v3(("get_time", T_ARGS)), False),
    ("deepseek_v31", "named", "get_weather", True, v31(("get_weather", W_ARGS)), True),
    ("deepseek_v31", "named", "get_weather", True, v31(("get_time", T_ARGS)), False),
    ("deepseek_v31", "auto", None, True, "Plain text.", True),
]


@pytest.mark.parametrize("fmt,mode,named,parallel,text,accepted", GRAMMAR_CASES)
def test_the_forced_call_grammar_and_the_parser_agree(grammars, tokenizer, fmt, mode, named, parallel, text, accepted):
    import xgrammar as xgr

    plan = ToolPlan(fmt, check_tools([WEATHER, TIME]), ToolChoice(mode, named), parallel)
    matcher = xgr.GrammarMatcher(grammars.get(tool_constraint(plan, "")))
    assert (matcher.accept_string(text) and matcher.accept_token(tokenizer.eos_token_id)) is accepted
    if accepted:
        for call in PARSERS[fmt].parse(text, parallel, schemas=plan.schemas)[1]:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_an_opening_the_vocabulary_makes_special_leaves_auto_free() -> None:
    plan = ToolPlan("glm45", check_tools([WEATHER]), ToolChoice("auto"))
    assert tool_constraint(plan, "") is not None and tool_constraint(plan, "", special_trigger=True) is None
    forced = ToolPlan("glm45", check_tools([WEATHER]), ToolChoice("required"))
    assert tool_constraint(forced, "", special_trigger=True) is not None
