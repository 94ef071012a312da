"""`llama3_json`: Llama 3.1 / 3.2's JSON tool calls, `{"name": ..., "parameters": {...}}`.

The answer starts with the call (optionally after `<|python_tag|>`); several calls are separated by `;`.
A `{"name": ` later in the text opens a call too (the constrained "auto" lets one start anywhere); an
object there that is no call (no "parameters" or "arguments" after the name) stays in the content.
"""

from __future__ import annotations

from typing import ClassVar

from worker.openai.tools.events import Event
from worker.openai.tools.parser import ToolParser

PYTHON_TAG = "<|python_tag|>"
NAMED_OBJECT = '{"name":'


class Llama3JsonParser(ToolParser):
    name: ClassVar[str] = "llama3_json"
    openers: ClassVar[tuple[str, ...]] = (PYTHON_TAG, NAMED_OBJECT)

    def find_opener(self) -> tuple[int, str]:
        if not self.shown:
            start = len(self.buffer) - len(self.buffer.lstrip())
            if self.buffer[start : start + 1] == "{":
                return start, "{"
        return super().find_opener()

    def enter(self, opener: str) -> None:
        self.phase = "between"

    def after_not_a_call(self) -> None:
        self.shown = True  # a leading "{" that was no call: the rest of the answer is prose

    def step_calls(self, final: bool, events: list[Event]) -> bool:
        if self.phase == "body":
            read = self.read_object(final, events)
            if read.end is None:
                return False
            self.consume(read.end)
            self.close_call(read, events)
            self.phase = "between"
            return True
        self.skip_space(";" if self.calls else "")
        if self.buffer.startswith(PYTHON_TAG):
            self.consume(len(PYTHON_TAG))
            return True
        if self.buffer.startswith("{"):
            self.phase = "body"
            self.new_object(needs_arguments=True)
            return True
        if not self.buffer or (PYTHON_TAG.startswith(self.buffer) and not final):
            return False
        # Prose (or python code after the tag) where a call should be: no call.
        self.consume(len(self.buffer))
        self.close_call(None, events)
        return False
