"""A Messages request's conversation and tools as the chat layer takes them.

`system` becomes a system message; a user turn's `tool_result` blocks become `tool` messages (before the
turn's text, where Anthropic puts them); an assistant turn's `tool_use` blocks become its `tool_calls` and its
`thinking` blocks its `reasoning_content` (which templates that show past reasoning render). A user turn's
`image` blocks become chat's image_url parts (base64 sources as data: URLs, url sources as they are), which a
vision model takes and a text-only one refuses; documents and other block types are refused with a 400 naming the
block.
"""

from __future__ import annotations

import json
import re
from typing import Any

from worker.anthropic.request import ToolChoice
from worker.openai.errors import BadRequest

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
ERROR_PREFIX = "Error: "  # how a tool_result with is_error reads to the model


def chat_messages(system: str | list[dict[str, Any]] | None, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as chat messages."""
    out: list[dict[str, Any]] = []
    if system:
        text = system if isinstance(system, str) else _texts(system, "system", ("text",))
        out.append({"role": "system", "content": text})
    called: set[str] = set()  # the previous message's tool_use ids: the only ones a tool_result may answer
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise BadRequest(f"{where}.role: must be 'user' or 'assistant', got {role!r}", param=f"{where}.role")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise BadRequest(f"{where}.content: must be a string or a list of content blocks", param=f"{where}.content")
        elif role == "user":
            out += _user_turn(content, f"{where}.content", called)
        else:
            out.append(_assistant_turn(content, f"{where}.content"))
        called = {c["id"] for c in out[-1].get("tool_calls", [])} if role == "assistant" and out else set()
    return out


def _user_turn(blocks: list[Any], where: str, called: set[str]) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []  # chat's text and image_url parts, in order
    for j, block in enumerate(blocks):
        kind = _kind(block, f"{where}.{j}")
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, f"{where}.{j}")})
        elif kind == "image":
            parts.append(
                {"type": "image_url", "image_url": {"url": _image_url(block, f"{where}.{j}")}, "where": f"{where}.{j}"}
            )
        elif kind == "tool_result":
            results.append(_tool_result(block, f"{where}.{j}", called))
        else:
            _refuse(kind, f"{where}.{j}", "a user turn takes text, image and tool_result blocks")
    if not parts:
        return results
    if all(p["type"] == "text" for p in parts):
        return [*results, {"role": "user", "content": "\n".join(p["text"] for p in parts)}]
    return [*results, {"role": "user", "content": parts}]


def _image_url(block: dict[str, Any], where: str) -> str:
    """An image block's source as chat's image URL: base64 data as a data: URL, a url source as it is."""
    source = block.get("source")
    if not isinstance(source, dict):
        source = {}
    kind = source.get("type")
    if kind == "base64" and isinstance(source.get("data"), str) and isinstance(source.get("media_type"), str):
        return f"data:{source['media_type']};base64,{source['data']}"
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise BadRequest(
        f"{where}.source: an image source must be {{type: base64, media_type, data}} or {{type: url, url}}",
        param=f"{where}.source",
    )


def _tool_result(block: dict[str, Any], where: str, called: set[str]) -> dict[str, Any]:
    """A tool_result as chat's tool message; it must answer a tool_use of the previous message, as Anthropic
    requires (a result the model never asked for would be rendered against no call)."""
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise BadRequest(f"{where}.tool_use_id: Field required", param=f"{where}.tool_use_id")
    if call_id not in called:
        raise BadRequest(
            f"{where}: unexpected `tool_use_id` found in `tool_result` blocks: {call_id}. Each "
            "`tool_result` block must have a corresponding `tool_use` block in the previous message.",
            param=where,
        )
    content = block.get("content", "")
    text = content if isinstance(content, str) else _texts(content, f"{where}.content", ("text",))
    if block.get("is_error"):
        text = ERROR_PREFIX + text
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _assistant_turn(blocks: list[Any], where: str) -> dict[str, Any]:
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        kind = _kind(block, f"{where}.{j}")
        if kind == "text":
            texts.append(_text(block, f"{where}.{j}"))
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise BadRequest(f"{where}.{j}.thinking: must be a string", param=f"{where}.{j}.thinking")
            thinking.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # another service's encrypted reasoning: nothing a local model can read
        elif kind == "tool_use":
            calls.append(_tool_use(block, f"{where}.{j}"))
        else:
            _refuse(kind, f"{where}.{j}", "an assistant turn takes text, thinking and tool_use blocks")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not isinstance(name, str):
        raise BadRequest(f"{where}: a tool_use block needs a string id and name", param=where)
    if not isinstance(arguments, dict):
        raise BadRequest(f"{where}.input: must be an object", param=f"{where}.input")
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _kind(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise BadRequest(f"{where}: a content block must be an object with a type", param=where)
    return block["type"]


def _text(block: dict[str, Any], where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise BadRequest(f"{where}.text: must be a string", param=f"{where}.text")
    return block["text"]


def _texts(blocks: Any, where: str, kinds: tuple[str, ...]) -> str:
    if not isinstance(blocks, list):
        raise BadRequest(f"{where}: must be a string or a list of text blocks", param=where)
    for j, block in enumerate(blocks):
        kind = _kind(block, f"{where}.{j}")
        if kind not in kinds:
            _refuse(kind, f"{where}.{j}", "only text blocks are taken here")
    return "\n".join(_text(block, f"{where}.{j}") for j, block in enumerate(blocks))


def _refuse(kind: str, where: str, rule: str) -> None:
    if kind in ("image", "document"):
        raise BadRequest(
            f"{where}: {kind} blocks are not supported here (only in a user turn)"
            if kind == "image"
            else f"{where}: document blocks are not supported",
            param=where,
        )
    raise BadRequest(f"{where}: block type {kind!r} is not supported here; {rule}", param=where)


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Custom tools (`name`, `description`, `input_schema`) as chat's function tools; server tools are refused."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if tool.get("type") not in (None, "custom"):
            raise BadRequest(
                f"{where}.type: {tool.get('type')!r} is one of Anthropic's server tools, which this "
                "worker does not run; define it as a custom tool (name, description, input_schema)",
                param=f"{where}.type",
            )
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise BadRequest(
                f"{where}.name: must be 1 to 64 letters, digits, underscores or dashes, got {name!r}",
                param=f"{where}.name",
            )
        if not isinstance(schema, dict) or schema.get("type") != "object":
            raise BadRequest(
                f"{where}.input_schema: must be a JSON schema of type 'object'", param=f"{where}.input_schema"
            )
        function = {"name": name, "parameters": schema}
        for key in ("description", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: ToolChoice | None, tools: list[dict[str, Any]] | None) -> str | dict[str, Any] | None:
    """`auto`, `any`, `tool` (named) and `none` as chat's tool_choice."""
    if choice is None:
        return None
    if choice.type in ("any", "tool") and not tools:
        raise BadRequest(f"tool_choice: type {choice.type!r} needs tools", param="tool_choice")
    if choice.type == "tool":
        if choice.name not in {t["function"]["name"] for t in tools or []}:
            raise BadRequest(f"tool_choice.name: {choice.name!r} is not one of the tools", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]
