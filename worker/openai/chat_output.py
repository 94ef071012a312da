"""Reading one generated answer: reasoning split off first, then tool calls parsed from what follows.

`OutputFormat.parse(text)` reads a finished answer; `OutputFormat.stream()` reads one as it arrives. Both
give the same reasoning, content and calls (the whole form runs the streaming one over the whole text).
`OutputFormat.end_reader()` reads it inside the engine, to end it where its parser takes no further call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from worker.openai.reasoning import Piece, ReasoningParser
from worker.openai.tools.events import (
    ContentDelta,
    Event,
    ReasoningDelta,
    ToolCall,
    ToolCallStarted,
    fold_calls,
    fold_text,
)
from worker.openai.tools.parser import ToolParser


class ParsedOutput(NamedTuple):
    """A finished answer: `(reasoning, content, tool_calls)`; content is None when calls came with no text."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


@dataclass(frozen=True, kw_only=True)
class OutputFormat:
    """How a request's answers are read: its tool-call parser (None: no tools) and its reasoning split."""

    tool_parser: type[ToolParser] | None = None
    parallel: bool = True
    reasoning: str | None = None  # the reasoning parser's name; None: no reasoning split
    in_reasoning: bool = False  # the prompt left the reasoning open
    separate_reasoning: bool = True  # False (SGLang's option): the reasoning stays in the content as written
    max_calls: int | None = None  # the most tool calls one answer may make (MAX_TOOL_CALLS_PER_ANSWER)
    schemas: Mapping[str, Any] = field(default_factory=dict)  # each tool's parameters schema, by name
    forced: bool = False  # tool_choice "required" or a named tool: the answer is calls only, never markup as text

    @property
    def plain(self) -> bool:
        """Nothing to parse: the text is the content."""
        return self.tool_parser is None and self.reasoning is None

    def stream(self) -> OutputStream:
        return OutputStream(self)

    @staticmethod
    def reasoning_tokens(tokenizer: Any, token_ids: list[int], end: int | None, skip: bool = True) -> int:
        return reasoning_tokens(tokenizer, token_ids, end, skip)

    def end_reader(self) -> AnswerEnd:
        return AnswerEnd(self)

    def parse(self, text: str) -> ParsedOutput:
        return self.read(text)[0]

    def read(self, text: str, token_ids: list[int] | None = None) -> tuple[ParsedOutput, int | None]:
        """The parsed answer and where its reasoning ended in `text` (for counting its tokens); `token_ids` are
        for the harmony reader's sake (worker/openai/harmony/output.py), which reads tokens, not text."""
        stream = self.stream()
        events = stream.push(text) + stream.finish()
        return stream.result(events), stream.reasoning_end


class OutputStream:
    """One answer read as it arrives: `push(delta_text) -> events`, then `finish() -> events`.

    Events are ContentDelta, ReasoningDelta, ToolCallStarted(index, id, name) and ToolCallArguments(index,
    fragment) (worker/openai/tools/events.py); markup never shows up in them.
    """

    def __init__(self, fmt: OutputFormat) -> None:
        self.format = fmt
        self.reasoning = ReasoningParser(fmt.in_reasoning, fmt.reasoning) if fmt.reasoning else None
        self.tools = (
            fmt.tool_parser(fmt.parallel, fmt.max_calls, fmt.schemas, forced=fmt.forced) if fmt.tool_parser else None
        )
        self.called = False  # some call started

    def push(self, text: str, token_ids: object = ()) -> list[Event]:
        if not text:
            return []
        if self.reasoning is None:
            return self._content(text)
        return self._pieces(self.reasoning.push(text))

    def finish(self) -> list[Event]:
        events = self._pieces(self.reasoning.finish()) if self.reasoning is not None else []
        if self.tools is not None:
            events += self._seen(self.tools.finish())
        return events

    @property
    def ended(self) -> bool:
        """No further call will be taken, so nothing the model writes from here is part of the answer."""
        return self.tools is not None and self.tools.done

    @property
    def reasoning_end(self) -> int | None:
        """Where the reasoning ended in the text (past its closing tag); the text's length when it never did."""
        if self.reasoning is None or not self.reasoning.had_reasoning:
            return None
        return self.reasoning.end if self.reasoning.end is not None else self.reasoning.seen

    def result(self, events: list[Event]) -> ParsedOutput:
        """The whole answer that a list of this stream's events describes."""
        calls = fold_calls(events)
        content = fold_text(events, ContentDelta)
        reasoning = fold_text(events, ReasoningDelta)
        return ParsedOutput(reasoning or None, (content or None) if calls else content, calls)

    def _pieces(self, pieces: list[Piece]) -> list[Event]:
        events: list[Event] = []
        for piece in pieces:
            if piece.part == "content":
                events += self._content(piece.text)
            elif self.format.separate_reasoning:
                if piece.part == "reasoning":
                    events.append(ReasoningDelta(piece.text))
            else:
                events.append(ContentDelta(piece.text))
        return events

    def _content(self, text: str) -> list[Event]:
        return self._seen(self.tools.push(text)) if self.tools is not None else [ContentDelta(text)]

    def _seen(self, events: list[Event]) -> list[Event]:
        self.called = self.called or any(isinstance(e, ToolCallStarted) for e in events)
        return events


class AnswerEnd:
    """The engine's stop reader (SamplingParams.stop_reader) for answers read for tool calls: the answer ends
    ("stop") where its parser takes no further call, so a model that keeps repeating a forced call, or keeps
    calling past MAX_TOOL_CALLS_PER_ANSWER, stops there instead of running on to max_tokens."""

    def __init__(self, fmt: OutputFormat) -> None:
        self._stream = OutputStream(fmt)

    def push(self, text: str) -> bool:
        self._stream.push(text)
        return self._stream.ended


def reasoning_tokens(tokenizer: Any, token_ids: list[int], end: int | None, skip_special_tokens: bool = True) -> int:
    """How many of an answer's tokens it took to write its first `end` characters (the reasoning): the fewest
    whose text reaches that far, found by halving."""
    if not end or not token_ids:
        return 0

    def length(k: int) -> int:
        return len(
            tokenizer.decode(token_ids[:k], skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
        )

    low, high = 1, len(token_ids)
    if length(high) < end:
        return high
    while low < high:
        mid = (low + high) // 2
        if length(mid) >= end:
            high = mid
        else:
            low = mid + 1
    return low
