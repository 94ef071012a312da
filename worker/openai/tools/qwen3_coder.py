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

import re
from typing import ClassVar

from worker.openai.tools.events import Event
from worker.openai.tools.xml_arguments import XmlArgumentsParser

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
SEED_OPEN = "<seed:tool_call>"
SEED_CLOSE = "</seed:tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_KEY = re.compile(r"[^<>\n]{1,256}")
_MAX_TAG = 300  # past this without its `>`, a tag is no tag


class Qwen3CoderParser(XmlArgumentsParser):
    name: ClassVar[str] = "qwen3_coder"
    call_open: ClassVar[str] = OPEN
    call_close: ClassVar[str] = CLOSE
    openers: ClassVar[tuple[str, ...]] = (OPEN,)
    value_end: ClassVar[str] = PARAMETER_END
    value_ends: ClassVar[tuple[str, ...]] = (PARAMETER_END, FUNCTION_END, CLOSE)
    # what may begin a value's end, the newline before it included
    value_end_prefixes: ClassVar[tuple[str, ...]] = value_ends + tuple("\n" + end for end in value_ends)

    def new_arguments(self) -> None:
        super().new_arguments()
        self.value_opened = False  # the open value's leading newline was read

    def trimmed(self, raw: str) -> str:
        return raw.removesuffix("\n")

    def enter(self, opener: str) -> None:
        self.consume(len(self.call_open))
        self.phase = "function"

    def step_calls(self, final: bool, events: list[Event]) -> bool:
        if self.phase == "function":
            return self._function(final, events)
        if self.phase == "body":
            return self._body(final, events)
        if self.phase == "value":
            return self._value(final, events)
        if self.phase == "close":
            return self.past_close(self.call_close, final)
        if self.past_opener(self.call_open, final):
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
            return self.end_at(self.call_close, final, events)
        self.start_call(name, events)
        self.new_arguments()
        self.stream_arguments(self.arguments, events)
        self.phase = "body"
        return True

    def _body(self, final: bool, events: list[Event]) -> bool:
        """Between parameters: the next `<parameter=KEY>`, or the function's end."""
        self.skip_space()
        if not self.buffer:
            return False
        for end, phase in ((FUNCTION_END, "close"), (self.call_close, "between")):
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
            return self.end_at(self.call_close, final, events)  # the markup broke off: the call ends with what it had
        self.open_member(key, events)
        self.value_opened = False  # the value's leading newline is not read yet
        self.phase = "value"
        return True

    def _value(self, final: bool, events: list[Event]) -> bool:
        if not self.value_opened:
            if not self.buffer:
                return False
            if self.buffer.startswith("\n"):
                self.consume(1)
            self.value_opened = True
        return self.read_value(final, events)


class SeedOssParser(Qwen3CoderParser):
    """`seed_oss`: Seed-OSS's calls, Qwen3-Coder's `<function=...>` / `<parameter=...>` inside
    `<seed:tool_call>` ... `</seed:tool_call>` (vLLM's parser of that name)."""

    name: ClassVar[str] = "seed_oss"
    call_open: ClassVar[str] = SEED_OPEN
    call_close: ClassVar[str] = SEED_CLOSE
    openers: ClassVar[tuple[str, ...]] = (SEED_OPEN,)
    value_ends: ClassVar[tuple[str, ...]] = (PARAMETER_END, FUNCTION_END, SEED_CLOSE)
    value_end_prefixes: ClassVar[tuple[str, ...]] = value_ends + tuple("\n" + end for end in value_ends)
