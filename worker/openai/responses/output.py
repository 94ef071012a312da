"""A response's output items, built from the parsed answer's events: a `reasoning` item, a `message` item and
`function_call` items, in the order the model wrote them, with the stream events that announce each.

The same builder serves whole and streamed answers, so both give the same items. A finished message carries
its `phase`: `final_answer` when it ends the output, `commentary` when more items (a call) follow it. A plain
answer (no tools, no reasoning parser) is one message whose text deltas carry their tokens' logprobs; when the
text is parsed, the logprobs of every token go on the message's finished part instead, since parsed pieces no
longer line up with tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from worker.openai.logprobs import chat_logprobs
from worker.openai.responses.items import new_id
from worker.openai.tools.events import ContentDelta, Event, ReasoningDelta, ToolCallArguments, ToolCallStarted

EventFactory = Callable[..., dict[str, Any]]  # (type, **fields) -> a numbered stream event


class OutputItems:
    """Consumes answer events (`push`), closes what is open at the end (`finish`); both return stream events."""

    def __init__(self, event: EventFactory, top_logprobs: int, wants_logprobs: bool) -> None:
        self.event = event
        self.top = top_logprobs
        self.wants_logprobs = wants_logprobs
        self.items: list[dict[str, Any]] = []  # finished items, in output order
        self.open: dict[str, Any] | None = None
        self.text = ""  # the open item's text (a message's, a reasoning item's) or a call's arguments
        self.logprobs: list[dict[str, Any]] = []  # the open message's
        # Logprobs of tokens that brought no text yet (a character split across tokens): they go out with the
        # next text delta, or on the message at the end.
        self.pending: list[dict[str, Any]] = []

    def logprob_entries(self, positions: list[Any] | None) -> list[dict[str, Any]]:
        return chat_logprobs(positions or [], self.top)["content"] if self.wants_logprobs else []

    def push(self, events: list[Event], logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """Stream events for these answer events; `logprobs` go with the text deltas (plain answers only)."""
        out: list[dict[str, Any]] = []
        self.pending += logprobs or []
        for e in events:
            if isinstance(e, ContentDelta) and e.text:
                out += self._open("message") + self._text(e.text, self.pending)
                self.pending = []
            elif isinstance(e, ReasoningDelta) and e.text:
                out += self._open("reasoning") + self._text(e.text, [])
            elif isinstance(e, ToolCallStarted):
                out += self._open("function_call", e)
            elif isinstance(e, ToolCallArguments):
                self.text += e.fragment
                out.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=self._item["id"],
                        output_index=len(self.items),
                        delta=e.fragment,
                    )
                )
        return out

    def finish(self, status: str, all_logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """Close the last item (`status`: completed or incomplete); an answer with no item gets an empty message.
        `all_logprobs`: every token's, for a parsed answer's message."""
        out = [] if self.items or self.open else self._open("message")
        if self.open is not None and self.open["type"] == "message":
            self.logprobs = all_logprobs if all_logprobs is not None else self.logprobs + self.pending
        return out + self._close(status, "final_answer")

    def _open(self, kind: str, call: ToolCallStarted | None = None) -> list[dict[str, Any]]:
        if self.open is not None and self.open["type"] == kind and call is None:
            return []
        out = self._close("completed", "commentary")  # more output follows this item
        index = len(self.items)
        if kind == "message":
            self.open = {
                "id": new_id("msg"),
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
        elif kind == "reasoning":
            self.open = {"id": new_id("rs"), "type": "reasoning", "status": "in_progress", "summary": []}
        else:
            assert call is not None, "a function_call item opens on its call"
            self.open = {
                "id": new_id("fc"),
                "type": "function_call",
                "status": "in_progress",
                "call_id": call.id,
                "name": call.name,
                "arguments": "",
            }
        self.text, self.logprobs = "", []
        out.append(self.event("response.output_item.added", output_index=index, item=dict(self.open)))
        if kind == "message":
            out.append(self.event("response.content_part.added", **self._where(), part=_text_part("", [])))
        return out

    def _text(self, text: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        self.text += text
        if self._item["type"] == "reasoning":
            return [self.event("response.reasoning_text.delta", **self._where(), delta=text)]
        self.logprobs += logprobs
        return [self.event("response.output_text.delta", **self._where(), delta=text, logprobs=logprobs)]

    def _close(self, status: str, phase: str) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        item, where, out = self.open, self._where(), []
        kind = item["type"]
        if kind == "message":
            part = _text_part(self.text, self.logprobs)
            out.append(self.event("response.output_text.done", **where, text=self.text, logprobs=self.logprobs))
            out.append(self.event("response.content_part.done", **where, part=part))
            item = {**item, "status": status, "phase": phase, "content": [part]}
        elif kind == "reasoning":
            out.append(self.event("response.reasoning_text.done", **where, text=self.text))
            item = {**item, "status": "completed", "content": [{"type": "reasoning_text", "text": self.text}]}
        else:
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=where["output_index"],
                    name=item["name"],
                    arguments=self.text,
                )
            )
            item = {**item, "status": "completed", "arguments": self.text}
        out.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        self.items.append(item)
        self.open = None
        return out

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._item["id"], "output_index": len(self.items), "content_index": 0}

    @property
    def _item(self) -> dict[str, Any]:
        """The open item, where one must be open."""
        assert self.open is not None, "no output item is open"
        return self.open


def _text_part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
