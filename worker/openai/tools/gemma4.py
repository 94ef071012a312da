"""`gemma4`: Gemma 4's own calls, `<|tool_call>call:NAME{key:value,...}<tool_call|>`, one block per call and
several in a row for parallel calls (vLLM's `--tool-call-parser gemma4`).

The arguments are not JSON (worker/openai/tools/gemma4_values.py reads them into JSON as they stream). The
markup is made of special tokens in Gemma 4's vocabulary (`<|tool_call>`, `<tool_call|>`, the `<|"|>` quote):
chat.py keeps special tokens in the text while this parser reads it. After its calls the model writes
`<|tool_response>` (a stop token of Gemma 4's), where the answer ends.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar

from worker.openai.tools.events import Event
from worker.openai.tools.gemma4_values import ArgumentsReader
from worker.openai.tools.parser import ToolParser

OPEN = "<|tool_call>"
CLOSE = "<tool_call|>"
CALL = "call:"
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_MAX_HEAD = len(CALL) + 64  # past this without the arguments' `{`, it is no call


class Gemma4Parser(ToolParser):
    name: ClassVar[str] = "gemma4"
    openers: ClassVar[tuple[str, ...]] = (OPEN,)

    def __init__(
        self,
        parallel: bool = True,
        max_calls: int | None = None,
        schemas: Mapping[str, Any] | None = None,
        *,
        forced: bool = False,
    ) -> None:
        super().__init__(parallel, max_calls, schemas, forced=forced)
        self._arguments = ArgumentsReader()

    def enter(self, opener: str) -> None:
        self.consume(len(OPEN))
        self.phase = "head"

    def step_calls(self, final: bool, events: list[Event]) -> bool:
        if self.phase == "head":
            return self._head(final, events)
        if self.phase == "arguments":
            return self._read_arguments(final, events)
        if self.phase == "close":
            return self.past_close(CLOSE, final)
        return self._between(final)

    def _head(self, final: bool, events: list[Event]) -> bool:
        """`call:NAME` up to the arguments' `{`: the call starts once its whole name is known."""
        self.skip_space()
        brace = self.buffer.find("{")
        head = self.buffer if brace < 0 else self.buffer[:brace]
        fits = head.startswith(CALL) or (brace < 0 and CALL.startswith(head))
        if brace < 0 and fits and not final and len(head) <= _MAX_HEAD and "\n" not in head:
            return False
        name = head[len(CALL) :].strip() if fits else ""
        if brace < 0 or not _NAME.fullmatch(name):
            return self.end_at(CLOSE, final, events)
        self.consume(brace)
        self.start_call(name, events)
        self._arguments = ArgumentsReader()
        self.phase = "arguments"
        return True

    def _read_arguments(self, final: bool, events: list[Event]) -> bool:
        reader = self._arguments
        self.stream_arguments(reader.read(self.buffer, final), events)
        if reader.end is not None:
            self.consume(reader.end)
            self.close_call(None, events)
            self.phase = "close"
            return True
        if reader.broken:  # the syntax broke off: the call ends with what it had, at its closing token
            return self.end_at(CLOSE, final, events)
        return False

    def _between(self, final: bool) -> bool:
        if self.past_opener(OPEN, final):
            self.phase = "head"
            return True
        return False
