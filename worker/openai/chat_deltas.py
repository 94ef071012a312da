"""Parsed-output events as the `delta` objects of `chat.completion.chunk`s, the way OpenAI streams them.

A call opens with `{"index", "id", "type": "function", "function": {"name", "arguments": ""}}` and grows by
`{"index", "function": {"arguments": fragment}}`; reasoning goes out under both names clients read.
Consecutive events of one kind share a delta.
"""

from __future__ import annotations

from typing import Any

from worker.openai.tools.events import ContentDelta, Event, ReasoningDelta, ToolCallArguments, ToolCallStarted


def delta_dicts(events: list[Event]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    previous: Event | None = None
    for event in events:
        last = out[-1] if out else None
        if isinstance(event, ContentDelta):
            if isinstance(previous, ContentDelta) and last is not None:
                last["content"] += event.text
            else:
                out.append({"content": event.text})
        elif isinstance(event, ReasoningDelta):
            if isinstance(previous, ReasoningDelta) and last is not None:
                last["reasoning_content"] += event.text
                last["reasoning"] += event.text
            else:
                out.append({"reasoning_content": event.text, "reasoning": event.text})
        elif isinstance(event, ToolCallStarted):
            out.append(
                {
                    "tool_calls": [
                        {
                            "index": event.index,
                            "id": event.id,
                            "type": "function",
                            "function": {"name": event.name, "arguments": ""},
                        }
                    ]
                }
            )
        elif isinstance(event, ToolCallArguments):
            if isinstance(previous, ToolCallArguments) and previous.index == event.index and last is not None:
                last["tool_calls"][0]["function"]["arguments"] += event.fragment
            else:
                out.append({"tool_calls": [{"index": event.index, "function": {"arguments": event.fragment}}]})
        previous = event
    return out
