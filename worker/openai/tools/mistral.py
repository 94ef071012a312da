"""`mistral`: `[TOOL_CALLS]` and then either a JSON list of `{"name", "arguments"}` objects (Mistral 7B v0.3,
Mixtral, Nemo) or, from tokenizer v11 on (Mistral Small 3.2, Magistral, Devstral), `name[ARGS]{...}` per
call, each after its own `[TOOL_CALLS]`.

`[TOOL_CALLS]` is a special token in Mistral's vocabularies: chat.py keeps special tokens in the text
while this parser reads it, as vLLM does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar

from worker.openai.tools.call_reader import JsonScanner
from worker.openai.tools.events import Event
from worker.openai.tools.parser import ToolParser

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_MAX_NAME = 200  # past this without [ARGS], it is not a name


class MistralParser(ToolParser):
    name: ClassVar[str] = "mistral"
    openers: ClassVar[tuple[str, ...]] = (TOOL_CALLS,)
    named_calls: ClassVar[bool] = True  # `name[ARGS]{...}` after the opener (v11) as well as a JSON list

    def __init__(
        self,
        parallel: bool = True,
        max_calls: int | None = None,
        schemas: Mapping[str, Any] | None = None,
        *,
        forced: bool = False,
    ) -> None:
        super().__init__(parallel, max_calls, schemas, forced=forced)
        self._value = JsonScanner()  # the arguments object of a `name[ARGS]{...}` call

    def enter(self, opener: str) -> None:
        self.consume(len(opener))
        self.phase = "opened"

    def step_calls(self, final: bool, events: list[Event]) -> bool:
        if self.phase == "opened":
            self.skip_space()
            if not self.buffer:
                return False
            if self.buffer.startswith("["):
                self.consume(1)
                self.phase = "list"
            elif self.named_calls:
                self.phase = "name"
            else:  # no list after the opener: the markup was no call
                self.consume(len(self.buffer))
                self.close_call(None, events)
                self.phase = "between"
                return False
            return True
        if self.phase == "list":
            return self._list(final, events)
        if self.phase == "object":
            read = self.read_object(final, events)
            if read.end is None:
                return False
            self.consume(read.end)
            self.close_call(read, events)
            self.phase = "list"
            return True
        if self.phase == "name":
            return self._name(final, events)
        if self.phase == "args":
            return self._args(events)
        return self._between(final)

    def _list(self, final: bool, events: list[Event]) -> bool:
        self.skip_space(",")
        if self.buffer.startswith("]"):
            self.consume(1)
            self.phase = "between"
            return True
        if self.buffer.startswith("{"):
            self.phase = "object"
            self.new_object()
            return True
        if not self.buffer:
            return False
        self.consume(len(self.buffer))
        self.close_call(None, events)
        self.phase = "between"
        return False

    def _name(self, final: bool, events: list[Event]) -> bool:
        at = self.buffer.find(ARGS)
        if at < 0:
            if not final and len(self.buffer) <= _MAX_NAME and "\n" not in self.buffer:
                return False
            self.consume(len(self.buffer))
            self.close_call(None, events)
            self.phase = "between"
            return False
        name = self.buffer[:at].split(CALL_ID)[0].strip()
        if not _NAME.fullmatch(name):
            self.consume(at + len(ARGS))
            self.close_call(None, events)
            self.phase = "between"
            return True
        self.consume(at + len(ARGS))
        self.start_call(name, events)
        self.phase = "args"
        self._value = JsonScanner()
        return True

    def _args(self, events: list[Event]) -> bool:
        self.skip_space()
        if not self.buffer:
            return False
        if self.buffer[0] not in "{[":
            self.close_call(None, events)  # no arguments object: the call takes none
            self.phase = "between"
            return True
        end = self._value.scan(self.buffer)
        self.stream_arguments(self.buffer if end is None else self.buffer[:end], events)
        if end is None:
            return False
        self.consume(end)
        self.close_call(None, events)
        self.phase = "between"
        return True

    def _between(self, final: bool) -> bool:
        self.skip_space()
        at, opener = self.find_opener()
        if at == 0:
            self.consume(len(opener))
            self.phase = "opened"
            return True
        if not self.buffer or (self.held(self.buffer) == len(self.buffer) and not final):
            return False
        if at > 0:
            self.consume(at)
            return True
        self.consume(len(self.buffer) - (0 if final else self.held(self.buffer)))
        return False


class GraniteParser(MistralParser):
    """`granite`: IBM Granite 3.x's calls, a JSON list of {"name", "arguments"} objects after `<|tool_call|>`
    (Granite 3.0, a special token) or `<tool_call>` (3.1 on), as vLLM's parser of that name reads them."""

    name: ClassVar[str] = "granite"
    openers: ClassVar[tuple[str, ...]] = ("<|tool_call|>", "<tool_call>")
    named_calls: ClassVar[bool] = False


class Phi4MiniParser(MistralParser):
    """`phi4_mini_json`: Phi-4-mini's calls, `functools[` and a JSON list of {"name", "arguments"} objects `]`, as
    vLLM's parser of that name reads them."""

    name: ClassVar[str] = "phi4_mini_json"
    openers: ClassVar[tuple[str, ...]] = ("functools",)
    named_calls: ClassVar[bool] = False
