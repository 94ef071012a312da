"""Tools and tool history as the chat template sees them.

Templates that know tools get the tools as `tools` and the history as OpenAI messages, with each call's
`arguments` as an object (Llama 3.1's, Qwen2.5's and Mistral's templates apply `tojson` to them) and, for
Mistral, call ids cut to the nine characters its templates demand (as vLLM does). Templates that know no
tools (the `generic` format) get plain turns instead: the tools described in the system message (at the head of the
first user turn where the template refuses a system turn, as Gemma 2's does), calls written out as `<tool_call>`
blocks, and results as sentences naming the function in a user turn.
"""

from __future__ import annotations

import json
from typing import Any

from worker.openai.tools.definitions import Tool, ToolChoice

GENERIC_INTRO = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
GENERIC_CALL = (
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
GENERIC_RESULT = "The function {name} returned:"
GENERIC_UNNAMED_RESULT = "A function returned:"  # a result whose call is not in the history
GENERIC_ANSWER = "\n\nAnswer with this result."
ONE_CALL = "Call at most one function per answer."
MUST_CALL = "Answer with function calls only."


def generic_system_text(tools: list[Tool], parallel: bool, choice: ToolChoice | None = None) -> str:
    """The tools' description that the generic format adds to the system message."""
    lines = [GENERIC_INTRO, *(json.dumps(t.spec, ensure_ascii=False) for t in tools), "</tools>", "", GENERIC_CALL]
    if choice is not None and choice.mode == "named":
        lines.append(f"Answer by calling {choice.name}.")
    elif choice is not None and choice.mode == "required":
        lines.append(MUST_CALL)
    if not parallel:
        lines.append(ONE_CALL)
    return "\n".join(lines)


def generic_call_text(name: str, arguments: Any) -> str:
    """One call as the generic format writes it (and as the model is asked to)."""
    head = json.dumps(name, ensure_ascii=False)
    return f'<tool_call>\n{{"name": {head}, "arguments": {_arguments_text(arguments)}}}\n</tool_call>'


def generic_messages(
    messages: list[dict[str, Any]],
    tools: list[Tool],
    parallel: bool,
    choice: ToolChoice | None = None,
    system_turn: bool = True,
) -> list[dict[str, Any]]:
    """Messages for a template without tool support: tools in the system message, calls and results as text.

    Without `system_turn` (the template refuses one) the tools open the first user turn instead."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call id -> the function it called, to say whose result a tool turn is
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            calls = [
                generic_call_text(c["function"]["name"], c["function"].get("arguments")) for c in message["tool_calls"]
            ]
            names.update((c.get("id") or "", c["function"]["name"]) for c in message["tool_calls"])
            text = "\n".join(([message["content"]] if message.get("content") else []) + calls)
            out.append({"role": "assistant", "content": text})
        elif role == "tool":
            # NOTE: plain words, not <tool_response> tags: small models without tool training copy the tags
            # back as their answer, while a sentence naming the function gets them to answer with the result.
            name = names.get(message.get("tool_call_id") or "")
            head = GENERIC_RESULT.format(name=name) if name else GENERIC_UNNAMED_RESULT
            block = f"{head}\n{message.get('content') or ''}"
            if out and out[-1].get("tool_results"):  # results of one turn's calls share one user turn
                out[-1]["content"] = out[-1]["content"].removesuffix(GENERIC_ANSWER) + "\n" + block + GENERIC_ANSWER
            else:
                out.append({"role": "user", "content": block + GENERIC_ANSWER, "tool_results": True})
        else:
            out.append({k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")})
    for message in out:
        message.pop("tool_results", None)
    if tools:
        text = generic_system_text(tools, parallel, choice)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text}
        elif system_turn:
            out.insert(0, {"role": "system", "content": text})
        else:
            first = next((i for i, m in enumerate(out) if m.get("role") == "user"), None)
            if first is None:
                out.insert(0, {"role": "user", "content": text})
            else:
                content = out[first].get("content") or ""
                out[first] = {**out[first], "content": f"{text}\n\n{content}" if content else text}
    return out


def template_messages(messages: list[dict[str, Any]], short_ids: bool = False) -> list[dict[str, Any]]:
    """Messages for a template that knows tools: call arguments as objects, ids cut to 9 when `short_ids`."""
    out = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                function = dict(call["function"])
                function["arguments"] = _arguments_object(function.get("arguments"))
                call = {**call, "function": function}
                if short_ids and isinstance(call.get("id"), str):
                    call["id"] = call["id"][-9:]
                calls.append(call)
            message["tool_calls"] = calls
        if short_ids and isinstance(message.get("tool_call_id"), str):
            message["tool_call_id"] = message["tool_call_id"][-9:]
        out.append(message)
    return out


def _arguments_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments  # not JSON: the template shows it as written
    return {} if arguments is None else arguments


def _arguments_text(arguments: Any) -> str:
    if isinstance(arguments, str):
        return arguments.strip() or "{}"
    return json.dumps({} if arguments is None else arguments, ensure_ascii=False)
