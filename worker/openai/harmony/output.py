"""Reading a gpt-oss answer token by token with openai-harmony's StreamableParser.

`analysis` becomes reasoning, a `commentary` message to `functions.NAME` a tool call (its JSON text the
arguments), `final` (and a commentary preamble) the content; the markup never reaches the events. The answer
ends at `<|return|>` or `<|call|>`, which the engine is given as stop tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from worker.openai.chat_output import ParsedOutput
from worker.openai.tools.events import (
    ContentDelta,
    Event,
    ReasoningDelta,
    ToolCallArguments,
    ToolCallStarted,
    fold_calls,
    fold_text,
    new_call_id,
)

log = logging.getLogger("worker")
FUNCTIONS = "functions."


@dataclass(frozen=True, kw_only=True)
class HarmonyFormat:
    """How a gpt-oss request's answers are read: the encoding, and the tokens the prompt forced the answer to
    start with (they are the answer's own opening, so the parser reads them first)."""

    encoding: Any = field(repr=False)
    forced: tuple[int, ...] = ()
    separate_reasoning: bool = True
    tool_parser: None = None  # the answer ends on a stop token, not where a text parser says
    reasoning: str = "harmony"
    plain: bool = False

    def stream(self) -> HarmonyStream:
        return HarmonyStream(self)

    def read(self, text: str, token_ids: list[int] | None = None) -> tuple[ParsedOutput, int]:
        """The parsed answer and how many of its tokens were reasoning."""
        stream = self.stream()
        events = stream.push(text, token_ids or []) + stream.finish()
        return stream.result(events), stream.reasoning_end

    def parse(self, text: str, token_ids: list[int] | None = None) -> ParsedOutput:
        return self.read(text, token_ids)[0]

    @staticmethod
    def reasoning_tokens(tokenizer: Any, token_ids: list[int], end: int | None, skip: bool = True) -> int:
        return end or 0  # the harmony stream counts them itself


class HarmonyStream:
    """One answer's tokens -> events (ContentDelta, ReasoningDelta, ToolCallStarted, ToolCallArguments)."""

    def __init__(self, fmt: HarmonyFormat) -> None:
        from openai_harmony import Role, StreamableParser

        self.format = fmt
        self.parser = StreamableParser(fmt.encoding, role=Role.ASSISTANT)
        self.called = False
        self.ended = False
        self.calls = 0
        self.call_message: int | None = None  # the parser's message count when the open call started
        self.reasoning_count = 0
        self.broken = False
        for token in fmt.forced:
            self.parser.process(token)

    @property
    def reasoning_end(self) -> int:
        """How many of the answer's tokens were reasoning (analysis)."""
        return self.reasoning_count

    def push(self, text: str, token_ids: list[int] | tuple[int, ...] = ()) -> list[Event]:
        events: list[Event] = []
        for token in token_ids:
            events += self._token(token)
        return events

    def finish(self) -> list[Event]:
        if not self.broken:
            try:
                self.parser.process_eos()
            except Exception:  # an answer cut short (max_tokens) inside a header: its text was given already
                pass
        self.ended = True
        return []

    def result(self, events: list[Event]) -> ParsedOutput:
        calls = fold_calls(events)
        content = fold_text(events, ContentDelta)
        reasoning = fold_text(events, ReasoningDelta)
        return ParsedOutput(reasoning or None, (content or None) if calls else content, calls)

    def _token(self, token: int) -> list[Event]:
        if self.broken:
            return [ContentDelta(self.format.encoding.decode([token]))]
        try:
            self.parser.process(token)
        except Exception as exc:
            # Not harmony (a model off its format): what follows is kept as raw text, never dropped.
            log.warning("harmony parser: %s; the rest of the answer is returned as plain content", exc)
            self.broken = True
            return [ContentDelta(self.format.encoding.decode([token]))]
        delta = self.parser.last_content_delta
        channel = self.parser.current_channel
        recipient = self.parser.current_recipient or ""
        if channel == "analysis" and self._in_content() and not self.format.encoding.is_special_token(token):
            self.reasoning_count += 1
        if not delta:
            return []
        if recipient.startswith(FUNCTIONS):
            return self._call(recipient[len(FUNCTIONS) :], delta)
        if channel == "analysis":
            return [ReasoningDelta(delta)] if self.format.separate_reasoning else [ContentDelta(delta)]
        return [ContentDelta(delta)]

    def _in_content(self) -> bool:
        from openai_harmony import StreamState

        return self.parser.state == StreamState.CONTENT

    def _call(self, name: str, delta: str) -> list[Event]:
        events: list[Event] = []
        message = len(self.parser.messages)
        if self.call_message != message:
            self.call_message = message
            events.append(ToolCallStarted(self.calls, new_call_id(), name))
            self.calls += 1
            self.called = True
        events.append(ToolCallArguments(self.calls - 1, delta))
        return events
