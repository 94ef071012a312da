"""What parsing a generated text yields: parsed calls and the stream events that build them up.

A stream of events folds into the whole answer: content deltas join into the content, reasoning deltas
into the reasoning, and each call is its `ToolCallStarted` plus its `ToolCallArguments` fragments joined.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass


def new_call_id() -> str:
    """`call_` and 24 hex digits, as OpenAI's ids look (the last 9 are alphanumeric, which Mistral's need)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One call the model made: `arguments` is JSON text, as OpenAI's `function.arguments`."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, object]:
        """The chat API's `tool_calls[]` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ContentDelta:
    """The next piece of the answer's content."""

    text: str


@dataclass
class ReasoningDelta:
    """The next piece of the answer's reasoning."""

    text: str


@dataclass
class ToolCallStarted:
    """A call begins: its position among this answer's calls, its id and the function's name."""

    index: int
    id: str
    name: str


@dataclass
class ToolCallArguments:
    """The next piece of call `index`'s arguments text."""

    index: int
    fragment: str


Event = ContentDelta | ReasoningDelta | ToolCallStarted | ToolCallArguments


def fold_calls(events: list[Event]) -> list[ToolCall]:
    """The calls a list of events describes, arguments joined."""
    calls: dict[int, ToolCall] = {}
    for event in events:
        if isinstance(event, ToolCallStarted):
            calls[event.index] = ToolCall(event.id, event.name, "")
        elif isinstance(event, ToolCallArguments):
            calls[event.index].arguments += event.fragment
    return [calls[i] for i in sorted(calls)]


def fold_text(events: list[Event], kind: type[ContentDelta] | type[ReasoningDelta]) -> str:
    """The content (or reasoning) a list of events carries, joined."""
    return "".join(e.text for e in events if isinstance(e, kind))
