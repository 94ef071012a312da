"""`qwen3_coder`: the XML calls of Qwen3-Coder, Qwen3.5 and Qwen3.6 (vLLM's `--tool-call-parser qwen3_coder`):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

one block per call, several in a row for parallel calls. Values are raw text, typed by the tool's parameter schema
(worker/openai/tools/qwen3_coder_values.py). The arguments JSON streams as it is fixed: `{"city": ` at the
parameter's tag, a string's characters as they come (less what may still be its closing markup), any other value
at its closing tag; so the JSON after any prefix is a prefix of the whole text's JSON. A missing `</parameter>` is
forgiven at `</function>` or `</tool_call>`, a missing `</function>` at `</tool_call>`; a call cut short closes
with what it had (a valid object).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, ClassVar

from worker.openai.tools.call_reader import CallRead
from worker.openai.tools.events import Event
from worker.openai.tools.parser import ToolParser, held_prefix
from worker.openai.tools.qwen3_coder_values import is_text, parameter_schema, typed_value

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"
# Where a value ends (the first of them); what may begin one, a newline before included, is held back.
VALUE_ENDS = (PARAMETER_END, FUNCTION_END, CLOSE)
_HELD = VALUE_ENDS + tuple("\n" + end for end in VALUE_ENDS)
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_KEY = re.compile(r"[^<>\n]{1,256}")
_MAX_TAG = 300  # past this without its `>`, a tag is no tag


def _escaped(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


class Qwen3CoderParser(ToolParser):
    name: ClassVar[str] = "qwen3_coder"
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
        self._new_arguments()

    def _new_arguments(self) -> None:
        self._json = "{"  # the open call's arguments JSON as fixed so far
        self._members = 0
        self._schema: Any = None  # the open parameter's schema
        self._text = False  # the open parameter's value is a string (streamed as it comes)
        self._opened = False  # the open value's leading newline was read

    def enter(self, opener: str) -> None:
        self.consume(len(OPEN))
        self.phase = "function"

    def step_calls(self, final: bool, events: list[Event]) -> bool:
        if self.phase == "function":
            return self._function(final, events)
        if self.phase == "body":
            return self._body(final, events)
        if self.phase == "value":
            return self._value(final, events)
        if self.phase == "close":
            return self.past_close(CLOSE, final)
        if self.past_opener(OPEN, final):
            self.phase = "function"
            return True
        return False

    def _tag(self, tag: str, final: bool) -> str | None:
        """The name in `<tag...=NAME>` at the buffer's start, consumed; "" while it may still come, None if it is no
        such tag."""
        if not self.buffer.startswith(tag):
            return "" if tag.startswith(self.buffer) and not final else None
        end = self.buffer.find(">", len(tag))
        if end < 0:
            waits = not final and len(self.buffer) <= _MAX_TAG and "\n" not in self.buffer[len(tag) :]
            return "" if waits else None
        name = self.buffer[len(tag) : end].strip()
        if not name:
            return None
        self.consume(end + 1)
        return name

    def _function(self, final: bool, events: list[Event]) -> bool:
        self.skip_space()
        if not self.buffer:
            return False
        name = self._tag(FUNCTION, final)
        if name == "":
            return False
        if name is None or not _NAME.fullmatch(name):
            return self.end_at(CLOSE, final, events)
        self.start_call(name, events)
        self._new_arguments()
        self.stream_arguments(self._json, events)
        self.phase = "body"
        return True

    def _body(self, final: bool, events: list[Event]) -> bool:
        """Between parameters: the next `<parameter=KEY>`, or the function's end."""
        self.skip_space()
        if not self.buffer:
            return False
        for end, phase in ((FUNCTION_END, "close"), (CLOSE, "between")):
            if self.buffer.startswith(end):
                self.consume(len(end))
                self.close_call(None, events)
                self.phase = phase
                return True
            if end.startswith(self.buffer) and not final:
                return False
        key = self._tag(PARAMETER, final)
        if key == "":
            return False
        if key is None or not _KEY.fullmatch(key):
            return self.end_at(CLOSE, final, events)  # the markup broke off: the call ends with what it had
        assert self._call is not None
        self._schema = parameter_schema(self.schemas, self._call.name, key)
        self._text = is_text(self._schema)
        self._json += (", " if self._members else "") + json.dumps(key, ensure_ascii=False) + ": "
        self._json += '"' if self._text else ""
        self._members += 1
        self._opened = False  # the value's leading newline is not read yet
        self.stream_arguments(self._json, events)
        self.phase = "value"
        return True

    def _value(self, final: bool, events: list[Event]) -> bool:
        if not self._opened:
            if not self.buffer:
                return False
            if self.buffer.startswith("\n"):
                self.consume(1)
            self._opened = True
        found = [(at, end) for end in VALUE_ENDS if (at := self.buffer.find(end)) >= 0]
        if found:
            at, end = min(found)
            self._end_value(self.consume(at), events)
            if end == PARAMETER_END:
                self.consume(len(end))
            self.phase = "body"
            return True
        if final:  # cut short: the value is what was written, less any beginning of its closing markup
            rest = self.consume(len(self.buffer))
            self._end_value(rest[: len(rest) - held_prefix(rest, VALUE_ENDS)], events)
            self.phase = "body"
            return True
        if self._text:  # a string streams as it comes, all but what may still be its closing markup
            ready = len(self.buffer) - held_prefix(self.buffer, _HELD)
            if ready:
                self._json += _escaped(self.consume(ready))
                self.stream_arguments(self._json, events)
        return False

    def _end_value(self, rest: str, events: list[Event]) -> None:
        rest = rest.removesuffix("\n")
        if self._text:
            self._json += _escaped(rest) + '"'
        else:
            self._json += typed_value(rest, self._schema)
        self._text = False
        self.stream_arguments(self._json, events)

    def close_call(self, read: CallRead | None, events: list[Event]) -> None:
        if self._call is not None:  # the arguments close, whatever was cut short
            if self.phase == "value":
                self._end_value("", events)
                self.phase = "body"
            self.stream_arguments(self._json + "}", events)
        super().close_call(read, events)
