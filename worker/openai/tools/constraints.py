"""Grammar constraints for tool calls: each format's call markup around each tool's arguments schema, as an
xgrammar structural tag (engine.sample.structured runs it).

- "required": only calls (one or more; one with parallel_tool_calls false), after any reasoning.
- a named function: exactly one call of it.
- "auto": free text until the format's call opening (`<tool_call>`, `{"name": `), then calls only (one with
  parallel_tool_calls false) until the answer ends: text after calls is no part of the answer anyway.
  Mistral's `[TOOL_CALLS]` is a special token the grammar cannot offer, so Mistral's "auto" stays free
  unless a tool is `strict` (then the opening is spelled out in plain tokens). So is Gemma 4's `<|tool_call>`, and
  any format's opening that the model's vocabulary makes a special token (read from the tokenizer: GLM's).

Gemma 4's arguments are not JSON: they are held to a grammar of their own (worker/openai/tools/gemma4_grammar.py).
Qwen3-Coder's (Qwen3.5's) `<parameter=KEY>\nVALUE\n</parameter>` blocks are held to the schema by xgrammar's own
qwen_xml style: the listed parameters only, in the schema's order, every required one, each value of its type;
GLM's `<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>` pairs by its glm_xml style. DeepSeek's calls (V3's and
R1's ```json blocks, V3.1's bare JSON) sit in one `<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>` block, as
Mistral v0.3's sit in one list.
NOTE: Gemma 4's markup (`<|tool_call>`, the `<|"|>` quote) is special tokens in its vocabulary, which grammars
never offer (engine.sample.structured.compiler blanks special tokens): a forced call is spelled out in plain
tokens, which the parser reads the same but which the model saw no calls written in.

Arguments are always held to the tool's `parameters` (xgrammar's schemas are strict: no properties beyond
the listed ones). A schema the grammar engine cannot enforce is a 400 for a `strict` tool; for other tools
the call's arguments are then held to any JSON object.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequest
from engine.sample.structured.rewrite import lengths_as_patterns
from engine.sample.structured.spec import JSON_MAX_WHITESPACE, StructuredSpec, check_schema
from worker.openai.errors import BadRequest
from worker.openai.reasoning import spacing, thought
from worker.openai.tools.definitions import Tool
from worker.openai.tools.gemma4_grammar import arguments_content
from worker.openai.tools.plan import ToolPlan

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True, kw_only=True)
class CallMarkup:
    """How one format writes a call: `begin` (with {name}) before the arguments, `end` after them."""

    begin: str
    end: str
    trigger: str  # the text that opens any call (a prefix of every `begin`)
    separator: str  # between consecutive calls
    special_trigger: bool = False  # the trigger is a special token the grammar cannot offer in free text
    wrap: tuple[str, str] | None = None  # markup around all the calls (its opening starts with the trigger)
    style: str | None = None  # xgrammar's style for arguments that are not JSON (qwen_xml, glm_xml)
    excludes: tuple[str, ...] = ()  # what a string value may not hold (the parser ends a value there)


HERMES = CallMarkup(
    begin='<tool_call>\n{{"name": {name}, "arguments": ', end="}\n</tool_call>", trigger="<tool_call>", separator="\n"
)
LLAMA3 = CallMarkup(begin='{{"name": {name}, "parameters": ', end="}", trigger='{"name": ', separator="; ")
MISTRAL_V11 = CallMarkup(
    begin="[TOOL_CALLS]{bare}[ARGS]", end="", trigger="[TOOL_CALLS]", separator="", special_trigger=True
)
MISTRAL_V3 = CallMarkup(
    begin='{{"name": {name}, "arguments": ',
    end="}",
    trigger="[TOOL_CALLS]",
    separator=", ",
    special_trigger=True,
    wrap=("[TOOL_CALLS] [", "]"),
)


# Granite 3.x: a JSON list of calls after <|tool_call|> (3.0) or <tool_call> (3.1 on); Phi-4-mini's after functools.
def json_list(opener: str) -> CallMarkup:
    return CallMarkup(
        begin='{{"name": {name}, "arguments": ', end="}", trigger=opener, separator=", ", wrap=(opener + "[", "]")
    )


PHI4_MINI = json_list("functools")
GEMMA4 = CallMarkup(
    begin="<|tool_call>call:{bare}", end="<tool_call|>", trigger="<|tool_call>", separator="", special_trigger=True
)
# A Qwen3-Coder string value may not hold </function> or </tool_call>: the parser ends a value there.
QWEN3_CODER = CallMarkup(
    begin="<tool_call>\n<function={bare}>\n",
    end="</function>\n</tool_call>",
    trigger="<tool_call>",
    separator="\n",
    style="qwen_xml",
    excludes=("</function>", "</tool_call>"),
)
# Seed-OSS: Qwen3-Coder's function and parameters inside <seed:tool_call>.
SEED_OSS = CallMarkup(
    begin="<seed:tool_call>\n<function={bare}>\n",
    end="</function>\n</seed:tool_call>",
    trigger="<seed:tool_call>",
    separator="\n",
    style="qwen_xml",
    excludes=("</function>", "</seed:tool_call>"),
)
# GLM-4.5's (4.6's, 4.7's) `<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>` pairs: xgrammar's glm_xml style.
GLM4_MOE = CallMarkup(
    begin="<tool_call>{bare}",
    end="</tool_call>",
    trigger="<tool_call>",
    separator="\n",
    style="glm_xml",
    excludes=("</tool_call>",),
)
_DS_CALLS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
DEEPSEEK_V3 = CallMarkup(
    begin="<｜tool▁call▁begin｜>function<｜tool▁sep｜>{bare}\n```json\n",
    end="\n```<｜tool▁call▁end｜>",
    trigger=_DS_CALLS[0],
    separator="\n",
    wrap=_DS_CALLS,
)
DEEPSEEK_V31 = CallMarkup(
    begin="<｜tool▁call▁begin｜>{bare}<｜tool▁sep｜>",
    end="<｜tool▁call▁end｜>",
    trigger=_DS_CALLS[0],
    separator="",
    wrap=_DS_CALLS,
)
_STYLES = {
    "hermes": HERMES,
    "generic": HERMES,
    "llama3_json": LLAMA3,
    "gemma4": GEMMA4,
    "qwen3_coder": QWEN3_CODER,
    "seed_oss": SEED_OSS,
    "phi4_mini_json": PHI4_MINI,
    "glm45": GLM4_MOE,
    "glm47": GLM4_MOE,
    "deepseek_v3": DEEPSEEK_V3,
    "deepseek_v31": DEEPSEEK_V31,
}


def markup(plan: ToolPlan, template: str) -> CallMarkup:
    if plan.format in _STYLES:
        return _STYLES[plan.format]
    if plan.format == "granite":
        return json_list("<|tool_call|>" if "<|tool_call|>" in template else "<tool_call>")
    return MISTRAL_V11 if "[ARGS]" in template else MISTRAL_V3


def tool_constraint(
    plan: ToolPlan,
    template: str,
    reasoning: str | None = None,
    in_reasoning: bool = False,
    special_trigger: bool = False,
) -> StructuredSpec | None:
    """The constraint for a request's tool calls, or None when decoding stays free. `reasoning` is the reasoning
    parser when the answer may think before it calls (None when the prompt closed the reasoning); `special_trigger`:
    the model's vocabulary makes the format's opening a special token (GLM's <tool_call> may be one), which "auto"'s
    grammar could not offer."""
    mode = plan.choice.mode
    if not plan.active:
        return None
    style = markup(plan, template)
    tools = [(i, t) for i, t in enumerate(plan.tools) if mode != "named" or t.name == plan.choice.name]
    special = style.special_trigger or special_trigger
    if mode == "auto" and special and not any(t.strict for _, t in tools):
        return None
    once = mode == "named" or not plan.parallel
    specs = [(_begin(style, tool), _content(style, tool, i)) for i, tool in tools]
    if mode == "auto":
        # Free text until the call markup opens; the calls then run to their end, and so does the answer.
        fmt: dict[str, Any] = {
            "type": "dispatch",
            "rules": [[style.trigger, _calls(style, specs, once)]],
            "loop": False,
        }
    else:
        fmt = _calls(style, specs, once, opened=False)
    if reasoning is not None:
        fmt = {"type": "sequence", "elements": [thought(in_reasoning, reasoning), spacing(), fmt]}
    value = json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)
    return StructuredSpec(kind="structural_tag", value=value, param="tools")


def _begin(style: CallMarkup, tool: Tool) -> str:
    return style.begin.format(name=json.dumps(tool.name, ensure_ascii=False), bare=tool.name)


def _content(style: CallMarkup, tool: Tool, index: int) -> dict[str, Any]:
    """What a call's arguments are held to: the tool's schema, as JSON, in Gemma 4's syntax or as Qwen3-Coder's
    `<parameter=KEY>` blocks (xgrammar's qwen_xml style: the schema's properties in its order, values typed)."""
    if style is GEMMA4:
        return arguments_content(tool, index)
    if style.style is not None:
        return {
            "type": "json_schema",
            "json_schema": _schema(tool, index),
            "style": style.style,
            "max_whitespace_cnt": JSON_MAX_WHITESPACE,
            "excludes": list(style.excludes),
        }
    return {"type": "json_schema", "json_schema": _schema(tool, index), "max_whitespace_cnt": JSON_MAX_WHITESPACE}


def _tag(begin: str, arguments: dict[str, Any], end: str) -> dict[str, Any]:
    return {"type": "tag", "begin": begin, "content": arguments, "end": end}


def _calls(
    style: CallMarkup, tools: list[tuple[str, dict[str, Any]]], once: bool, opened: bool = True
) -> dict[str, Any]:
    """One call or more (one when `once`) in the style's markup. `opened`: the trigger was already written, so the
    first call starts after it."""
    if style.wrap is not None:  # the calls in one block opened by the trigger (Mistral v3's list, DeepSeek's)
        objects = [_tag(begin, arguments, style.end) for begin, arguments in tools]
        listed = {
            "type": "tags_with_separator",
            "tags": objects,
            "separator": style.separator,
            "at_least_one": True,
            "stop_after_first": once,
        }
        begin, end = style.wrap
        return {"type": "tag", "begin": begin[len(style.trigger) :] if opened else begin, "content": listed, "end": end}
    whole = [_tag(begin, arguments, style.end) for begin, arguments in tools]
    separated = {
        "type": "tags_with_separator",
        "tags": whole,
        "separator": style.separator,
        "at_least_one": True,
        "stop_after_first": once,
    }
    if not opened:
        return separated
    first = {
        "type": "or",
        "elements": [_tag(begin[len(style.trigger) :], arguments, style.end) for begin, arguments in tools],
    }
    if once:
        return first
    more = (
        separated
        if not style.separator
        else {"type": "sequence", "elements": [{"type": "const_string", "value": style.separator}, separated]}
    )
    return {"type": "sequence", "elements": [first, {"type": "optional", "content": more}]}


def _schema(tool: Tool, index: int) -> dict[str, Any]:
    schema = tool.parameters if tool.parameters is not None else ANY_OBJECT
    param = f"tools[{index}].function.parameters"
    try:
        check_schema(schema, param)
    except InvalidRequest as exc:
        if tool.strict:
            raise BadRequest(f"{exc.message}; a strict tool's arguments must be enforceable", param=param) from None
        return ANY_OBJECT
    return lengths_as_patterns(schema)  # as the engine does for JSON schemas: the same language, cheaper masks
