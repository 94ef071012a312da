"""`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call.

The format of Hermes 2 Pro / 3, Qwen2.5 and Qwen3 (their chat templates describe the tools in `<tools>` and
show results in `<tool_response>`).
"""

from __future__ import annotations

from typing import ClassVar

from worker.openai.tools.events import Event
from worker.openai.tools.parser import ToolParser

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesParser(ToolParser):
    name: ClassVar[str] = "hermes"
    openers: ClassVar[tuple[str, ...]] = (OPEN,)

    def enter(self, opener: str) -> None:
        self.consume(len(OPEN))
        self.phase = "body"
        self.new_object(CLOSE)

    def step_calls(self, final: bool, events: list[Event]) -> bool:
        if self.phase == "between":
            return self._between(final)
        if self.phase == "close":
            return self.past_close(CLOSE, final)
        return self._body(final, events)

    def _body(self, final: bool, events: list[Event]) -> bool:
        self.skip_space()
        if not self.buffer:
            return False
        if not self.buffer.startswith("{"):
            return self.end_at(CLOSE, final, events)
        read = self.read_object(final, events)
        if read.end is not None:
            self.consume(read.end)
            self.close_call(read, events)
            self.phase = "close" if self.in_calls else self.phase
            return True
        if read.stopped is not None:  # the tag closed an object that never did: a broken call
            self.consume(read.stopped + len(CLOSE))
            self.close_call(None, events)
            self.phase = "between"
            return True
        return False

    def _between(self, final: bool) -> bool:
        if self.past_opener(OPEN, final):
            self.phase = "body"
            self.new_object(CLOSE)
            return True
        return False
