"""A message's content blocks, built from the parsed answer's events: `thinking`, `text` and `tool_use` blocks
in the order the model wrote them, with the stream events that open, fill and close each. Each block carries the
fields Anthropic's schema requires of it: a text block's `citations` (null: nothing is cited), a tool_use block's
`caller`.

The same builder serves whole and streamed answers, so both give the same blocks. A thinking block's
`signature` is empty: Anthropic signs its own reasoning so that it can check it when replayed, and this
worker keeps no keys (replayed thinking is shown to the template as it is).
"""

from __future__ import annotations

import copy
import json
import uuid
from typing import Any

from worker.openai.tools.events import ContentDelta, Event, ReasoningDelta, ToolCallArguments, ToolCallStarted


def tool_use_id(call_id: str) -> str:
    """A parsed call's id as Anthropic spells tool-use ids (`toolu_...`)."""
    return "toolu_" + (call_id.removeprefix("call_") or uuid.uuid4().hex[:24])


class ContentBlocks:
    """Consumes answer events (`push`), closes the last block (`finish`); both return stream events."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []  # in output order; the last one may still be open
        self.open = False
        self.arguments = ""  # the open tool_use block's input, as JSON text so far

    def push(self, events: list[Event]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, ContentDelta) and e.text:
                out += self._open("text")
                self.blocks[-1]["text"] += e.text
                out.append(self._delta({"type": "text_delta", "text": e.text}))
            elif isinstance(e, ReasoningDelta) and e.text:
                out += self._open("thinking")
                self.blocks[-1]["thinking"] += e.text
                out.append(self._delta({"type": "thinking_delta", "thinking": e.text}))
            elif isinstance(e, ToolCallStarted):
                out += self._open("tool_use", e)
            elif isinstance(e, ToolCallArguments) and e.fragment:
                self.arguments += e.fragment
                out.append(self._delta({"type": "input_json_delta", "partial_json": e.fragment}))
        return out

    def finish(self) -> list[dict[str, Any]]:
        return self._close()

    @property
    def called(self) -> bool:
        return any(block["type"] == "tool_use" for block in self.blocks)

    def _open(self, kind: str, call: ToolCallStarted | None = None) -> list[dict[str, Any]]:
        if self.open and self.blocks[-1]["type"] == kind and call is None:
            return []
        out = self._close()
        if kind == "text":
            block: dict[str, Any] = {"type": "text", "text": "", "citations": None}
        elif kind == "thinking":
            block = {"type": "thinking", "thinking": "", "signature": ""}
        else:
            assert call is not None, "a tool_use block opens on its call"
            # `caller` says who made the call: the model itself ("direct"); Anthropic's server tools are not run here.
            block = {
                "type": "tool_use",
                "id": tool_use_id(call.id),
                "name": call.name,
                "input": {},
                "caller": {"type": "direct"},
            }
        self.blocks.append(block)
        self.open, self.arguments = True, ""
        out.append(
            {"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": copy.deepcopy(block)}
        )
        return out

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def _close(self) -> list[dict[str, Any]]:
        if not self.open:
            return []
        self.open = False
        block, out = self.blocks[-1], []
        if block["type"] == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": block["signature"]}))
        elif block["type"] == "tool_use":
            block["input"] = tool_input(self.arguments)
        out.append({"type": "content_block_stop", "index": len(self.blocks) - 1})
        return out


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as its `input` object. Arguments cut off by max_tokens do not parse (nor would any that
    are not an object): their input is empty; the stream's input_json_delta events still carry every fragment."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
