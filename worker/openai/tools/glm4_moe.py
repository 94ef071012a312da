"""`glm45` (and `glm47`, the same): the calls of GLM-4.5, GLM-4.6, GLM-4.7 and GLM-4.7-Flash (vLLM's parsers of those
names):

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

one block per call, several in a row for parallel calls; GLM-4.7 writes the same without the newlines
(`<tool_call>NAME<arg_key>...</arg_key><arg_value>...</arg_value></tool_call>`). The chat templates write a string
value as it is and any other value as JSON: a value is typed by the tool's parameter schema when the schema lists
it (worker/openai/tools/qwen3_coder_values.py), and is otherwise the JSON it reads as, or its text. A string
parameter's value streams as it comes; any other value at its `</arg_value>`, so the arguments JSON after any
prefix is a prefix of the whole text's. A missing `</arg_value>` is forgiven at `</tool_call>`; a call cut short
closes with what it had (a valid object).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, ClassVar

from worker.openai.tools.call_reader import CallRead
from worker.openai.tools.events import Event
from worker.openai.tools.parser import ToolParser, held_prefix
from worker.openai.tools.qwen3_coder_values import is_text, parameter_schema, schema_types, typed_value

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
KEY = "<arg_key>"
KEY_END = "</arg_key>"
VALUE = "<arg_value>"
VALUE_END = "</arg_value>"
VALUE_ENDS = (VALUE_END, CLOSE)  # where a value ends (the first of them)
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_KEY_TEXT = re.compile(r"[^<>\n]{1,256}")
_MAX_HEAD = 300  # past this without the end of a name or a key, it is no call


def _escaped(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


def glm_value(raw: str, schema: Any) -> str:
    """The JSON text of a value as written: typed by its schema when the schema lists the parameter, else the JSON it
    reads as (the templates write non-strings with tojson), else a string."""
    if schema_types(schema) or isinstance(schema, dict) and ("enum" in schema or "const" in schema):
        return typed_value(raw, schema)
    try:
        return json.dumps(json.loads(raw.strip()), ensure_ascii=False)
    except ValueError:
        return json.dumps(raw, ensure_ascii=False)


class Glm4MoeParser(ToolParser):
    name: ClassVar[str] = "glm45"
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
        self._schema: Any = None  # the open value's schema
        self._text = False  # the open value is a string (streamed as it comes)

    def enter(self, opener: str) -> None:
        self.consume(len(OPEN))
        self.phase = "name"

    def step_calls(self, final: bool, events: list[Event]) -> bool:
        if self.phase == "name":
            return self._name(final, events)
        if self.phase == "body":
            return self._body(final, events)
        if self.phase == "value":
            return self._value_open(final, events)
        if self.phase == "text":
            return self._value(final, events)
        if self.past_opener(OPEN, final):
            self.phase = "name"
            return True
        return False

    def _name(self, final: bool, events: list[Event]) -> bool:
        """The function's name, up to its newline, its first `<arg_key>` or the call's end."""
        self.skip_space()
        ends = [at for end in ("\n", KEY, CLOSE) if (at := self.buffer.find(end)) >= 0]
        if not ends:
            if not final and len(self.buffer) <= _MAX_HEAD:
                return False
            return self.end_at(CLOSE, final, events)
        name = self.buffer[: min(ends)].strip()
        if not _NAME.fullmatch(name):
            return self.end_at(CLOSE, final, events)
        self.consume(min(ends))
        self.start_call(name, events)
        self._new_arguments()
        self.stream_arguments(self._json, events)
        self.phase = "body"
        return True

    def _body(self, final: bool, events: list[Event]) -> bool:
        """Between arguments: the next `<arg_key>KEY</arg_key>`, or the call's end."""
        self.skip_space()
        if not self.buffer:
            return False
        if self.buffer.startswith(CLOSE):
            self.consume(len(CLOSE))
            self.close_call(None, events)
            self.phase = "between"
            return True
        if not self.buffer.startswith(KEY):
            if (KEY.startswith(self.buffer) or CLOSE.startswith(self.buffer)) and not final:
                return False
            return self.end_at(CLOSE, final, events)  # the markup broke off: the call ends with what it had
        at = self.buffer.find(KEY_END, len(KEY))
        if at < 0:
            if not final and len(self.buffer) <= _MAX_HEAD:
                return False
            return self.end_at(CLOSE, final, events)
        key = self.buffer[len(KEY) : at].strip()
        if not _KEY_TEXT.fullmatch(key):
            return self.end_at(CLOSE, final, events)
        self.consume(at + len(KEY_END))
        assert self._call is not None
        self._schema = parameter_schema(self.schemas, self._call.name, key)
        self._text = bool(schema_types(self._schema)) and is_text(self._schema)
        self._json += (", " if self._members else "") + json.dumps(key, ensure_ascii=False) + ": "
        self._json += '"' if self._text else ""
        self._members += 1
        self.stream_arguments(self._json, events)
        self.phase = "value"
        return True

    def _value_open(self, final: bool, events: list[Event]) -> bool:
        """The `<arg_value>` after a key (whitespace between them allowed)."""
        self.skip_space()
        if self.buffer.startswith(VALUE):
            self.consume(len(VALUE))
            self.phase = "text"
            return True
        if not final and VALUE.startswith(self.buffer):
            return False
        return self.end_at(CLOSE, final, events)  # no value: the call ends with what it had

    def _value(self, final: bool, events: list[Event]) -> bool:
        found = [(at, end) for end in VALUE_ENDS if (at := self.buffer.find(end)) >= 0]
        if found:
            at, end = min(found)
            self._end_value(self.consume(at), events)
            if end == VALUE_END:
                self.consume(len(end))
            self.phase = "body"
            return True
        if final:  # cut short: the value is what was written, less any beginning of its closing markup
            rest = self.consume(len(self.buffer))
            self._end_value(rest[: len(rest) - held_prefix(rest, VALUE_ENDS)], events)
            self.phase = "body"
            return True
        if self._text:  # a string streams as it comes, all but what may still be its closing markup
            ready = len(self.buffer) - held_prefix(self.buffer, VALUE_ENDS)
            if ready:
                self._json += _escaped(self.consume(ready))
                self.stream_arguments(self._json, events)
        return False

    def _end_value(self, rest: str, events: list[Event]) -> None:
        if self._text:
            self._json += _escaped(rest) + '"'
        else:
            self._json += glm_value(rest, self._schema)
        self._text = False
        self.stream_arguments(self._json, events)

    def close_call(self, read: CallRead | None, events: list[Event]) -> None:
        if self._call is not None:  # the arguments close, whatever was cut short
            if self.phase in ("value", "text"):
                self._end_value("", events)
                self.phase = "body"
            self.stream_arguments(self._json + "}", events)
        super().close_call(read, events)


class Glm47Parser(Glm4MoeParser):
    """GLM-4.7's name for the same format (its calls without the newlines are read the same)."""

    name: ClassVar[str] = "glm47"
