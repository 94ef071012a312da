"""Responses API items: a request's `input` as stored items (ids included), and items as chat messages.

Clients replay a previous response's `output` items verbatim as the next `input`, so every output
item shape is also an input shape here. Reasoning items are kept in the record but not shown to the
chat template (as vLLM does); `item_reference` items are looked up among stored responses' items;
`compaction` items (worker/openai/responses/compact.py) show their summary as an assistant message.
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Callable
from typing import Any

from worker.openai.errors import BadRequest

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
PHASES = ("commentary", "final_answer")
COMPACTION_MARK = "compaction-v1:"


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


Lookup = Callable[[str], "dict[str, Any] | None"]  # a stored item by its id


def input_items(raw: str | list[dict[str, Any]], lookup: Lookup) -> list[dict[str, Any]]:
    """`input` as a list of complete items, each with an id; raises BadRequest naming `input[i]...`."""
    if isinstance(raw, str):
        raw = [{"type": "message", "role": "user", "content": raw}]
    if not raw:
        raise BadRequest("input must not be empty", param="input")
    return [_item(item, f"input[{i}]", lookup) for i, item in enumerate(raw)]


def _item(item: dict[str, Any], where: str, lookup: Lookup) -> dict[str, Any]:
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        return _message(item, where)
    if kind == "function_call":
        fields = _strings(item, where, "call_id", "name", "arguments")
        return {
            "id": item.get("id") or new_id("fc"),
            "type": kind,
            **fields,
            "status": item.get("status") or "completed",
        }
    if kind == "function_call_output":
        call_id = _strings(item, where, "call_id")["call_id"]
        output = item.get("output")
        if not isinstance(output, str):
            output = _text(output, f"{where}.output")
        return {
            "id": item.get("id") or new_id("fco"),
            "type": kind,
            "call_id": call_id,
            "output": output,
            "status": item.get("status") or "completed",
        }
    if kind == "reasoning":
        return {**item, "id": item.get("id") or new_id("rs"), "summary": item.get("summary") or []}
    if kind == "compaction":
        content = _strings(item, where, "encrypted_content")["encrypted_content"]
        compaction_summary(content, f"{where}.encrypted_content")
        return {"id": item.get("id") or new_id("cmp"), "type": kind, "encrypted_content": content}
    if kind == "item_reference":
        found = lookup(_strings(item, where, "id")["id"])
        if found is None:
            raise BadRequest(f"{where}: no stored item with id {item['id']!r}", param=f"{where}.id")
        return found
    raise BadRequest(
        f"{where}: item type {kind!r} is not supported; this worker takes message, function_call, "
        "function_call_output, reasoning, compaction and item_reference items",
        param=f"{where}.type",
    )


def _strings(item: dict[str, Any], where: str, *names: str) -> dict[str, str]:
    out = {}
    for name in names:
        value = item.get(name)
        if not isinstance(value, str):
            raise BadRequest(f"{where}.{name} must be a string", param=f"{where}.{name}")
        out[name] = value
    return out


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise BadRequest(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", param=f"{where}.role")
    part_type = "output_text" if role == "assistant" else "input_text"
    content = item.get("content")
    if (
        role != "assistant"
        and isinstance(content, list)
        and any(isinstance(p, dict) and p.get("type") == "input_image" for p in content)
    ):
        parts = _parts_with_images(content, f"{where}.content")
    else:
        text = content if isinstance(content, str) else _text(content, f"{where}.content")
        part: dict[str, Any] = {"type": part_type, "text": text}
        if role == "assistant":
            part["annotations"] = []
        parts = [part]
    out = {
        "id": item.get("id") or new_id("msg"),
        "type": "message",
        "role": role,
        "content": parts,
        "status": item.get("status") or "completed",
    }
    phase = item.get("phase")
    if phase is not None:
        if role != "assistant" or phase not in PHASES:
            raise BadRequest(
                f"{where}.phase must be one of {', '.join(PHASES)}, on an assistant message only",
                param=f"{where}.phase",
            )
        out["phase"] = phase
    return out


def _parts_with_images(parts: list[Any], where: str) -> list[dict[str, Any]]:
    """A user turn's text and input_image parts, in order (an image by URL or data: URL; file ids are refused)."""
    out = []
    for j, part in enumerate(parts):
        if isinstance(part, dict) and part.get("type") == "input_image":
            if not isinstance(part.get("image_url"), str):
                raise BadRequest(
                    f"{where}[{j}]: an input_image needs image_url (a URL or a data: URL); file_id is "
                    "not supported (this worker has no Files API)",
                    param=f"{where}[{j}].image_url",
                )
            out.append({"type": "input_image", "image_url": part["image_url"], "detail": part.get("detail") or "auto"})
        else:
            out.append({"type": "input_text", "text": _text([part], where)})
    return out


def _text(parts: Any, where: str) -> str:
    """Text content parts joined; anything else (images, files, audio) is refused, naming the part."""
    if not isinstance(parts, list):
        raise BadRequest(f"{where} must be a string or a list of content parts", param=where)
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("text", part.get("refusal")) if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(text, str):
            raise BadRequest(
                f"{where}[{j}]: content part type {kind!r} is not supported by this model; only text is",
                param=f"{where}[{j}]",
            )
        texts.append(text)
    return "\n".join(texts)


def compaction_content(summary: str) -> str:
    """A compaction item's `encrypted_content`: the summary, base64-encoded and marked; opaque to clients, not
    encrypted (this worker keeps no keys)."""
    return base64.b64encode((COMPACTION_MARK + summary).encode()).decode()


def compaction_summary(content: str, where: str) -> str:
    try:
        text = base64.b64decode(content, validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        text = ""
    if not text.startswith(COMPACTION_MARK):
        raise BadRequest(f"{where}: not a compaction made by this worker's /v1/responses/compact", param=where)
    return text.removeprefix(COMPACTION_MARK)


def item_text(item: dict[str, Any]) -> str:
    return "\n".join(part.get("text", "") for part in item["content"] if part.get("type") != "input_image")


def _chat_content(item: dict[str, Any], where: str) -> str | list[dict[str, Any]]:
    """A message item's chat content: its text, or with images its parts as chat's text and image_url parts (each
    naming its place, `where`.content[j], for errors)."""
    if not any(part.get("type") == "input_image" for part in item["content"]):
        return item_text(item)
    return [
        {
            "type": "image_url",
            "image_url": {"url": p["image_url"], "detail": p["detail"]},
            "where": f"{where}.content[{j}]",
        }
        if p["type"] == "input_image"
        else {"type": "text", "text": p["text"]}
        for j, p in enumerate(item["content"])
    ]


def chat_messages(items: list[dict[str, Any]], reasoning: bool = False, inputs_from: int = 0) -> list[dict[str, Any]]:
    """Items as chat messages: developer speaks as system, calls join the assistant turn they belong to.

    reasoning True (the harmony format): a reasoning item opens an assistant message as its
    `reasoning_content`, and the calls or answer that follow it join that message, so the turn replays as the
    model wrote it (analysis, then the call or the final answer); the renderer decides which reasoning the
    prompt keeps. Other formats leave reasoning items out, as vLLM does. items[inputs_from:] are the request's
    `input` (the ones before come from previous_response_id), which errors name."""
    messages: list[dict[str, Any]] = []
    for n, item in enumerate(items):
        kind = item["type"]
        last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            if role == "assistant" and last is not None and _thought_only(last):
                last["content"] = item_text(item)
            else:
                where = f"input[{n - inputs_from}]" if n >= inputs_from else "previous_response_id"
                messages.append({"role": role, "content": _chat_content(item, where)})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if last is None:
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        elif kind == "compaction":  # the model's own summary of the turns it replaces
            messages.append({"role": "assistant", "content": compaction_summary(item["encrypted_content"], "input")})
        elif kind == "reasoning" and reasoning and reasoning_text(item):
            messages.append({"role": "assistant", "content": "", "reasoning_content": reasoning_text(item)})
    return messages


def reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning item's text: its `reasoning_text` content (what this worker writes), else its summary."""
    for field, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(field)
        texts = (
            [
                p["text"]
                for p in parts
                if isinstance(p, dict) and p.get("type") == part_type and isinstance(p.get("text"), str)
            ]
            if isinstance(parts, list)
            else []
        )
        if texts:
            return "\n".join(texts)
    return ""


def _thought_only(message: dict[str, Any]) -> bool:
    """An assistant message that so far holds only reasoning: the turn's call or answer still to join it."""
    return bool(message.get("reasoning_content")) and not message["content"] and not message.get("tool_calls")


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools from the Responses API's flat shape to chat's nested one; other tool types are refused."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise BadRequest(
                f"tools[{i}]: only function tools (type 'function' with a name) are supported, got "
                f"type {tool.get('type')!r}",
                param=f"tools[{i}].type",
            )
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """`{"type": "function", "name": n}` as chat's `{"type": "function", "function": {"name": n}}`."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice
