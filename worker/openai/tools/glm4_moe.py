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
from typing import Any, ClassVar

from worker.openai.tools.events import Event
from worker.openai.tools.qwen3_coder_values import is_text, schema_types, typed_value
from worker.openai.tools.xml_arguments import XmlArgumentsParser

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
KEY = "<arg_key>"
KEY_END = "</arg_key>"
VALUE = "<arg_value>"
VALUE_END = "</arg_value>"
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_KEY_TEXT = re.compile(r"[^<>\n]{1,256}")
_MAX_HEAD = 300  # past this without the end of a name or a key, it is no call


def glm_value(raw: str, schema: Any) -> str:
    """The JSON text of a value as written: typed by its schema when the schema lists the parameter, else the JSON it
    reads as (the templates write non-strings with tojson), else a string."""
    if schema_types(schema) or isinstance(schema, dict) and ("enum" in schema or "const" in schema):
        return typed_value(raw, schema)
    try:
        return json.dumps(json.loads(raw.strip()), ensure_ascii=False)
    except ValueError:
        return json.dumps(raw, ensure_ascii=False)


class Glm4MoeParser(XmlArgumentsParser):
    name: ClassVar[str] = "glm45"
    openers: ClassVar[tuple[str, ...]] = (OPEN,)
    value_end: ClassVar[str] = VALUE_END
    value_ends: ClassVar[tuple[str, ...]] = (VALUE_END, CLOSE)
    value_end_prefixes: ClassVar[tuple[str, ...]] = value_ends
    value_phases: ClassVar[tuple[str, ...]] = ("value", "text")  # before `<arg_value>`, and after it

    def is_string(self, schema: Any) -> bool:
        """A string only where the schema says so: an unlisted parameter's value is typed at its end."""
        return bool(schema_types(schema)) and is_text(schema)

    def typed(self, raw: str, schema: Any) -> str:
        return glm_value(raw, schema)

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
            return self.read_value(final, events)
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
        self.new_arguments()
        self.stream_arguments(self.arguments, events)
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
        self.open_member(key, events)
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


class Glm47Parser(Glm4MoeParser):
    """GLM-4.7's name for the same format (its calls without the newlines are read the same)."""

    name: ClassVar[str] = "glm47"
