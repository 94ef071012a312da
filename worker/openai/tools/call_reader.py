"""Reading one call's JSON object as it arrives: the name as soon as it is written, then the arguments text.

Models write `{"name": ..., "arguments": {...}}` (Llama 3 says `parameters`) with the name first; the
reader then streams the arguments exactly as the model wrote them, so a client sees them grow. An object
in another key order is read once it is complete, its arguments re-serialized. Both paths depend only on
the text, so a text read in one piece and the same text read in any split give the same call.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

ARGUMENT_KEYS = ("arguments", "parameters")
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class JsonScanner:
    """Where a JSON object, array or string that starts at offset 0 ends, scanning only the text not yet seen.

    `stop`: markup that ends the value's text where JSON cannot go on (outside strings), e.g. `</tool_call>`
    after a call whose object never closed; `stopped` is then where it starts.
    """

    def __init__(self, stop: str | None = None) -> None:
        self.stop = stop
        self.pos = 0
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.end: int | None = None
        self.stopped: int | None = None

    def scan(self, text: str) -> int | None:
        """The index just past the value, or None while it is incomplete (brackets are counted, not checked)."""
        if self.end is not None or self.stopped is not None:
            return self.end
        stop = self.stop
        for i in range(self.pos, len(text)):
            c = text[i]
            if stop and not self.in_string and c == stop[0]:
                rest = text[i : i + len(stop)]
                if rest == stop:
                    self.stopped = i
                    return None
                if len(rest) < len(stop) and stop.startswith(rest):
                    self.pos = i  # it may be the stop markup: read again from here when more arrives
                    return None
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:
                        self.end = i + 1
                        return self.end
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.end = i + 1
                    return self.end
        self.pos = len(text)
        return None


@dataclass(kw_only=True)
class CallRead:
    """What is known of a call so far."""

    name: str | None  # as soon as the head `{"name": "...", "arguments": ` is read
    arguments: str  # the arguments text known so far (all of it when `end` is set and `valid`)
    end: int | None  # index just past the object, None while incomplete
    valid: bool  # complete, JSON, and a call
    stopped: int | None = None  # where the reader's stop markup cut an object that never closed


class CallReader:
    """Reads the text of one call object, from its `{`, each time more of it has arrived."""

    def __init__(self, stop: str | None = None, needs_arguments: bool = False) -> None:
        self._outer = JsonScanner(stop)
        self._needs_arguments = needs_arguments  # an object without an arguments key is no call
        self._value: JsonScanner | None = None
        self._name: str | None = None
        self._value_start: int | None = None  # where streamed arguments begin (None: read them whole at the end)

    def read(self, text: str) -> CallRead:
        if self._name is None:
            self._read_head(text)
        arguments = ""
        if self._value_start is not None and len(text) > self._value_start:
            assert self._value is not None
            value_end = self._value.scan(text[self._value_start :])
            stop = len(text) if value_end is None else self._value_start + value_end
            arguments = text[self._value_start : stop]
        end = self._outer.scan(text)
        if end is None:
            return CallRead(name=self._name, arguments=arguments, end=None, valid=False, stopped=self._outer.stopped)
        try:
            obj = json.loads(text[:end])
        except ValueError:
            return CallRead(name=self._name, arguments=arguments, end=end, valid=False)
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)) or (
            self._needs_arguments and not any(k in obj for k in ARGUMENT_KEYS)
        ):
            return CallRead(name=self._name, arguments=arguments, end=end, valid=False)
        if self._value_start is None or not arguments:
            raw: object = next((obj[k] for k in ARGUMENT_KEYS if k in obj), {})
            arguments = raw if isinstance(raw, str) else json.dumps(raw, ensure_ascii=False)
        return CallRead(name=obj["name"], arguments=arguments, end=end, valid=True)

    def _read_head(self, text: str) -> None:
        match = _HEAD.match(text)
        if match is None:
            return
        try:
            self._name = json.loads(f'"{match.group(1)}"')
        except ValueError:
            return
        start = match.end()
        # Only an object (or array) is streamed as written; a string or scalar is read whole at the end.
        if start < len(text) and text[start] in "{[":
            self._value_start = start
            self._value = JsonScanner()
        elif start >= len(text):
            self._name = None  # the value's first character decides; read the head again when it comes
