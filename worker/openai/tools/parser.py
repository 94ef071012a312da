"""ToolParser: the part every tool-call format shares, whole-text and streaming alike.

Text is content until the format's opening markup; from there the format's subclass reads calls. Whatever
could still turn out to be markup is held back (a trailing `<tool_c` waits for the next delta), and so is
trailing whitespace, which is dropped when a call follows it: no piece of markup reaches the content.
After the first call only further calls count; other text there is dropped, so the content is the text
before the calls. Markup that turns out to be no call (bad JSON before any call) is given back as content.
An answer takes no further call (`done`) after its one call with parallel_tool_calls false, at a call
that repeats an earlier one (same name and arguments; that call is dropped), and at a call past
`max_calls` (dropped too): a later call's events wait while its arguments so far could still make it a
repeat, so a dropped call never reaches a stream.
A `forced` answer (tool_choice "required" or a named tool) is calls only: markup that never became a call (an
answer cut by max_tokens inside the opener or before the call's name) is dropped, never given back as content.
`parse` runs the streaming form over the whole text, so both forms give the same answer by construction.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from worker.openai.tools.call_log import CallLog
from worker.openai.tools.call_reader import CallRead, CallReader
from worker.openai.tools.events import (
    ContentDelta,
    Event,
    ToolCall,
    ToolCallArguments,
    ToolCallStarted,
    fold_calls,
    fold_text,
    new_call_id,
)


def held_prefix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that is the start of a marker (and so cannot be shown yet)."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


class ToolParser:
    """One answer's tool-call parser: `push(delta) -> events`, then `finish() -> events`."""

    name: ClassVar[str]
    openers: ClassVar[tuple[str, ...]]  # markup that opens the calls wherever it appears

    def __init__(
        self,
        parallel: bool = True,
        max_calls: int | None = None,
        schemas: Mapping[str, Any] | None = None,
        *,
        forced: bool = False,
    ) -> None:
        self.parallel = parallel  # False: the first call is the only one
        self.forced = forced  # the answer is calls only (its grammar allows nothing else): markup is never content
        self.max_calls = max_calls  # the most calls one answer may make (None: no bound)
        self.schemas = schemas or {}  # each tool's parameters schema by name, for formats whose values are not JSON
        self.buffer = ""
        self.calls = 0  # calls started so far
        self.in_calls = False
        self.phase = ""  # where a format is in its call markup (each format names its own)
        self.done = False  # no further call is taken (after one call without parallel calls, a repeat, the bound)
        self.shown = False  # some content went out (Llama 3's leading "{" rule)
        self._space = ""  # the content's trailing whitespace, held until we know what follows it
        self._raw = ""  # markup read before the first call starts: content again if it is no call
        self._call: ToolCallStarted | None = None
        self._sent = 0  # arguments characters sent for the open call
        self._written = ""  # the open call's arguments as known so far
        self._held: list[Event] | None = None  # the open call's events while it may still be dropped
        self._dropped = False  # the open call is past max_calls: its events go nowhere
        self._log = CallLog()
        self._reader = CallReader()

    @classmethod
    def parse(
        cls,
        text: str,
        parallel: bool = True,
        max_calls: int | None = None,
        schemas: Mapping[str, Any] | None = None,
        *,
        forced: bool = False,
    ) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole text: content is None when there are calls and no text before them."""
        parser = cls(parallel, max_calls, schemas, forced=forced)
        events = parser.push(text) + parser.finish()
        calls = fold_calls(events)
        content = fold_text(events, ContentDelta)
        return (content or None) if calls else content, calls

    def push(self, text: str) -> list[Event]:
        self.buffer += text
        return self._run(final=False)

    def finish(self) -> list[Event]:
        """The end of the text: what was held back is settled (an open call closes as it is)."""
        events = self._run(final=True)
        if self.in_calls and not self.done:
            self.consume(len(self.buffer))
            if self._call is not None or self._raw:
                self.close_call(None, events)
        self.buffer = ""
        if self._space and not self.calls:
            events.append(ContentDelta(self._space))
            self.shown = True
        self._space = ""
        return events

    def _run(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while self.buffer:
            if self.done:
                self.buffer = ""
            elif self.in_calls:
                if not self.step_calls(final, events):
                    break
            elif not self._step_content(final, events):
                break
        return events

    def _step_content(self, final: bool, events: list[Event]) -> bool:
        at, opener = self.find_opener()
        if at >= 0:
            self.content(self.buffer[:at], events)
            self.buffer = self.buffer[at:]
            self.in_calls = True
            self._raw = ""
            self.enter(opener)
            return True
        keep = self.held(self.buffer) if not final or self.forced else 0
        self.content(self.buffer[: len(self.buffer) - keep], events)
        # At the end, what could only have begun an opener is dropped from a forced answer (cut inside it).
        self.buffer = "" if final else self.buffer[len(self.buffer) - keep :]
        return False

    def find_opener(self) -> tuple[int, str]:
        """The first opener in the buffer: (index, opener), or (-1, "")."""
        found = [(i, m) for m in self.openers if (i := self.buffer.find(m)) >= 0]
        return min(found) if found else (-1, "")

    def held(self, text: str) -> int:
        """How much of the buffer's end must wait for more text before it can be shown."""
        return held_prefix(text, self.openers)

    # Hooks for the formats.

    def enter(self, opener: str) -> None:
        """The buffer starts with `opener`: set up to read calls (consume what belongs to the opener)."""
        raise NotImplementedError

    def step_calls(self, final: bool, events: list[Event]) -> bool:
        """Read calls from the buffer; return whether anything was consumed (False: wait for more text)."""
        raise NotImplementedError

    # Building blocks for the formats.

    def content(self, text: str, events: list[Event]) -> None:
        if not text:
            return
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body) :]
        if body:
            events.append(ContentDelta(body))
            self.shown = True

    def consume(self, n: int) -> str:
        taken, self.buffer = self.buffer[:n], self.buffer[n:]
        if not self.calls:
            self._raw += taken
        return taken

    def skip_space(self, extra: str = "") -> None:
        n = len(self.buffer) - len(self.buffer.lstrip(" \t\r\n" + extra))
        if n:
            self.consume(n)

    def start_call(self, name: str, events: list[Event]) -> None:
        self._space = ""
        self._raw = ""
        self._call = ToolCallStarted(self.calls, new_call_id(), name)
        self._sent = 0
        self._written = ""
        self.calls += 1
        self._dropped = self.max_calls is not None and self.calls > self.max_calls
        if self._dropped:
            self.done = True  # known from the name on: the answer can end before this call is written out
        self._held = [] if self._dropped or self._log.may_repeat(name, "") else None
        self._emit(self._call, events)

    def stream_arguments(self, arguments: str, events: list[Event]) -> None:
        """The open call's arguments as known so far; sends what is new."""
        assert self._call is not None
        self._written = arguments
        if len(arguments) > self._sent:
            self._emit(ToolCallArguments(self._call.index, arguments[self._sent :]), events)
            self._sent = len(arguments)
        if self._held is not None and not self._dropped and not self._log.may_repeat(self._call.name, arguments):
            events += self._held  # it can no longer be a repeat: what waited goes out, in order
            self._held = None

    def _emit(self, event: Event, events: list[Event]) -> None:
        (self._held if self._held is not None else events).append(event)

    def read_object(self, final: bool, events: list[Event]) -> CallRead:
        """Read the call object at the buffer's start: start the call once its name is known, stream arguments."""
        read = self._reader.read(self.buffer)
        if self._call is None and read.name is not None:
            self.start_call(read.name, events)
        if self._call is not None and (read.end is None or read.valid):
            self.stream_arguments(read.arguments, events)
        return read

    def new_object(self, stop: str | None = None, needs_arguments: bool = False) -> None:
        """Read a new call object; `stop` is markup that ends it even if its JSON never closed."""
        self._reader = CallReader(stop, needs_arguments)

    def close_call(self, read: CallRead | None, events: list[Event]) -> None:
        """End the open call (or the markup that was to be one). `read` None: cut short."""
        if read is not None and read.valid:
            if self._call is None:
                self.start_call(read.name or "", events)
            self.stream_arguments(read.arguments, events)
        if self._call is None:
            self.not_a_call(events)
            return
        if self._sent == 0:
            self.stream_arguments("{}", events)
        call, held = self._call, self._held
        self._call, self._held = None, None
        if self._dropped or (held is not None and self._log.repeats(call.name, self._written)):
            self.calls -= 1  # neither a repeat nor a call past the bound is part of the answer, and it ends here
            self.done = True
            return
        if held:
            events += held  # cut short while it still looked like an earlier call: it is a call of its own
        self._log.add(call.name, self._written)
        if not self.parallel:
            self.done = True

    def end_at(self, close: str, final: bool, events: list[Event]) -> bool:
        """Markup that is no (whole) call runs to its closing `close`, or to the end of the text, and ends the call
        there; False while the text may still bring `close`."""
        at = self.buffer.find(close)
        if at < 0 and not final:
            return False
        self.consume(len(self.buffer) if at < 0 else at + len(close))
        self.close_call(None, events)
        self.phase = "between"
        return True

    def past_close(self, close: str, final: bool) -> bool:
        """After a call's object: consume its closing `close` (a missing one is forgiven) and go between calls;
        False while the text may still bring it."""
        self.skip_space()
        if self.buffer.startswith(close):
            self.consume(len(close))
        elif close.startswith(self.buffer) and not final:
            return False
        self.phase = "between"
        return True

    def past_opener(self, opener: str, final: bool) -> bool:
        """Between calls: consume through the next `opener` (True); without one the text so far is dropped, as text
        after the calls is not part of the answer, all but what may begin `opener`."""
        at = self.buffer.find(opener)
        if at >= 0:
            self.consume(at + len(opener))
            return True
        self.consume(len(self.buffer) - (0 if final else held_prefix(self.buffer, (opener,))))
        return False

    def not_a_call(self, events: list[Event]) -> None:
        """The markup read since the opener was no call: content again before any call, dropped after one."""
        raw, self._raw = self._raw, ""
        if self.calls:
            return
        self.in_calls = False
        if not self.forced:
            self.content(raw, events)
        self.after_not_a_call()

    def after_not_a_call(self) -> None:
        """Back in content after markup that was no call (a format may stop looking for calls)."""
