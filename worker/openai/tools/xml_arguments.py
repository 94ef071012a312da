"""The arguments of XML-style calls, one tag pair per parameter (`qwen3_coder`'s `<parameter=KEY>`, `glm45`'s
`<arg_key>KEY</arg_key><arg_value>`): the JSON object is fixed as it is read. `{"key": ` at the key, a string's
characters as they come (less what may still be its closing markup), any other value at its end, typed by the
tool's parameter schema (worker/openai/tools/qwen3_coder_values.py); so the JSON after any prefix is a prefix of
the whole text's. A format's parser says where its values end and how it types them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar

from worker.openai.tools.call_reader import CallRead
from worker.openai.tools.events import Event
from worker.openai.tools.parser import ToolParser, held_prefix
from worker.openai.tools.qwen3_coder_values import is_text, parameter_schema, typed_value


def escaped(text: str) -> str:
    """text inside a JSON string, without its quotes."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class XmlArgumentsParser(ToolParser):
    value_end: ClassVar[str]  # the tag that closes a value (read past)
    value_ends: ClassVar[tuple[str, ...]]  # where a value ends: the first of them (value_end or a call's end)
    value_end_prefixes: ClassVar[tuple[str, ...]]  # what may begin a value's end, held back while a string streams
    value_phases: ClassVar[tuple[str, ...]] = ("value",)  # the phases in which a value is open

    def __init__(
        self,
        parallel: bool = True,
        max_calls: int | None = None,
        schemas: Mapping[str, Any] | None = None,
        *,
        forced: bool = False,
    ) -> None:
        super().__init__(parallel, max_calls, schemas, forced=forced)
        self.new_arguments()

    def new_arguments(self) -> None:
        self.arguments = "{"  # the open call's arguments JSON as fixed so far
        self.members = 0
        self.value_schema: Any = None  # the open value's schema
        self.value_is_text = False  # the open value is a string (streamed as it comes)

    def is_string(self, schema: Any) -> bool:
        return is_text(schema)

    def typed(self, raw: str, schema: Any) -> str:
        """The JSON text of a non-string value as written."""
        return typed_value(raw, schema)

    def trimmed(self, raw: str) -> str:
        """A value as written, less the markup's own spacing."""
        return raw

    def open_member(self, key: str, events: list[Event]) -> None:
        """`"key": ` (and a string's opening quote) fixed and streamed."""
        assert self._call is not None
        self.value_schema = parameter_schema(self.schemas, self._call.name, key)
        self.value_is_text = self.is_string(self.value_schema)
        self.arguments += (", " if self.members else "") + json.dumps(key, ensure_ascii=False) + ": "
        self.arguments += '"' if self.value_is_text else ""
        self.members += 1
        self.stream_arguments(self.arguments, events)

    def read_value(self, final: bool, events: list[Event]) -> bool:
        """The open value up to its end (then phase "body"); a string streams as it comes."""
        found = [(at, end) for end in self.value_ends if (at := self.buffer.find(end)) >= 0]
        if found:
            at, end = min(found)
            self.end_value(self.consume(at), events)
            if end == self.value_end:
                self.consume(len(end))
            self.phase = "body"
            return True
        if final:  # cut short: the value is what was written, less any beginning of its closing markup
            rest = self.consume(len(self.buffer))
            self.end_value(rest[: len(rest) - held_prefix(rest, self.value_ends)], events)
            self.phase = "body"
            return True
        if self.value_is_text:
            ready = len(self.buffer) - held_prefix(self.buffer, self.value_end_prefixes)
            if ready:
                self.arguments += escaped(self.consume(ready))
                self.stream_arguments(self.arguments, events)
        return False

    def end_value(self, rest: str, events: list[Event]) -> None:
        rest = self.trimmed(rest)
        if self.value_is_text:
            self.arguments += escaped(rest) + '"'
        else:
            self.arguments += self.typed(rest, self.value_schema)
        self.value_is_text = False
        self.stream_arguments(self.arguments, events)

    def close_call(self, read: CallRead | None, events: list[Event]) -> None:
        if self._call is not None:  # the arguments close, whatever was cut short
            if self.phase in self.value_phases:
                self.end_value("", events)
                self.phase = "body"
            self.stream_arguments(self.arguments + "}", events)
        super().close_call(read, events)
