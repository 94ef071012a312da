"""Chat messages -> a harmony conversation -> prompt token ids, rendered by openai-harmony itself.

As gpt-oss's own chat template lays them out: the system message carries the reasoning effort; the request's
system/developer text goes into the developer message as instructions, with the tools (namespace `functions`)
and any response format; an assistant turn replays as its reasoning (analysis), its calls (commentary to
`functions.NAME`, `<|constrain|>json`) and its answer (final); a tool result comes from `functions.NAME`.
openai-harmony drops the reasoning of turns before the last final answer, as the format asks.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from typing import Any

from worker.openai.errors import BadRequest
from worker.openai.tools.definitions import Tool

EFFORTS = ("low", "medium", "high")
CALL_CONTENT_TYPE = "<|constrain|>json"
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")  # where a replayed turn's reasoning comes


@dataclass(frozen=True)
class ResponseFormat:
    """response_format's json_schema, shown to the model in the developer message."""

    name: str
    schema: dict[str, Any]


def conversation(
    messages: list[dict[str, Any]],
    tools: list[Tool],
    effort: str | None = None,
    response_format: ResponseFormat | None = None,
    today: datetime.date | None = None,
) -> Any:
    """openai_harmony.Conversation for chat messages (plain dicts, string content) and the tools shown."""
    from openai_harmony import (
        Conversation,
        DeveloperContent,
        Message,
        ReasoningEffort,
        Role,
        SystemContent,
        ToolDescription,
    )

    if effort is not None and effort not in EFFORTS:
        raise BadRequest(
            f"reasoning_effort must be one of {', '.join(EFFORTS)}, got {effort!r}", param="reasoning_effort"
        )
    system = SystemContent.new().with_conversation_start_date((today or datetime.date.today()).isoformat())
    if effort is not None:
        system = system.with_reasoning_effort(ReasoningEffort(effort.capitalize()))
    out = [Message.from_role_and_content(Role.SYSTEM, system)]
    lead = 0
    instructions = []
    while lead < len(messages) and messages[lead]["role"] in ("system", "developer"):
        instructions.append(messages[lead]["content"])
        lead += 1
    if response_format is not None:
        instructions.append(
            f"# Response Formats\n\n## {response_format.name}\n\n"
            f"{json.dumps(response_format.schema, ensure_ascii=False)}"
        )
    if instructions or tools:
        developer = DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions("\n\n".join(instructions))
        if tools:
            developer = developer.with_function_tools(
                [ToolDescription.new(t.name, t.description or "", t.parameters) for t in tools]
            )
        out.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    calls: dict[str, str] = {}  # tool_call_id -> function name, to name the tool results
    for index, message in enumerate(messages[lead:], start=lead):
        out += _messages(message, index, calls)
    return Conversation.from_messages(out)


def _messages(message: dict[str, Any], index: int, calls: dict[str, str]) -> list[Any]:
    from openai_harmony import Author, DeveloperContent, Message, Role

    role, text = message["role"], message["content"]
    if role in ("system", "developer"):  # past the leading ones: a developer message of its own
        return [Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_instructions(text))]
    if role == "user":
        return [Message.from_role_and_content(Role.USER, text)]
    if role == "tool":
        name = message.get("name") or calls.get(message.get("tool_call_id") or "")
        if not name:
            raise BadRequest(
                "a tool message must name its function (`name`) or answer an earlier call (`tool_call_id`)",
                param=f"messages.[{index}].tool_call_id",
            )
        author = Author.new(Role.TOOL, f"functions.{name}")
        return [Message.from_author_and_content(author, text).with_channel("commentary").with_recipient("assistant")]
    if role != "assistant":
        raise BadRequest(f"unknown message role {role!r}", param=f"messages.[{index}].role")
    out = []
    reasoning = next((message[f] for f in REASONING_FIELDS if isinstance(message.get(f), str) and message[f]), None)
    if reasoning:
        out.append(Message.from_role_and_content(Role.ASSISTANT, reasoning).with_channel("analysis"))
    tool_calls = message.get("tool_calls") or []
    if text:
        # Text next to calls is a preamble (commentary); on its own it is the answer (final).
        out.append(
            Message.from_role_and_content(Role.ASSISTANT, text).with_channel("commentary" if tool_calls else "final")
        )
    for call in tool_calls:
        function = call.get("function") or {}
        calls[call.get("id") or ""] = function.get("name", "")
        arguments = function.get("arguments") or "{}"
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        out.append(
            Message.from_role_and_content(Role.ASSISTANT, arguments)
            .with_channel("commentary")
            .with_recipient(f"functions.{function.get('name', '')}")
            .with_content_type(CALL_CONTENT_TYPE)
        )
    return out


def render(encoding: Any, conv: Any, forced: str = "") -> list[int]:
    """The prompt's token ids: the conversation, the assistant's turn opened, then `forced` (harmony text the
    answer must start with: a call's header for tool_choice, the final channel for a response format)."""
    from openai_harmony import Role

    ids = list(encoding.render_conversation_for_completion(conv, Role.ASSISTANT))
    if forced:
        ids += encoding.encode(forced, allowed_special="all")
    return ids
