"""`deepseek_v3` and `deepseek_v31`: DeepSeek's calls (vLLM's `deepseek_v3` / `deepseek_v31` parsers). V3, R1 and
R1-0528 write

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

and V3.1 `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>...
<｜tool▁calls▁end｜>` (the name before the separator, bare JSON after it). One parser reads both: after the separator,
a JSON object means V3.1's form, anything else is V3's name line. The arguments stream as the model writes them.
The two names differ only in the grammar of forced calls (worker/openai/tools/constraints.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar

from worker.openai.tools.call_reader import JsonScanner
from worker.openai.tools.events import Event
from worker.openai.tools.parser import ToolParser, held_prefix

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE = "```"
JSON_FENCE = "```json"
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_MAX_HEAD = 200  # past this without its end, a call's head is no head


class DeepSeekV3Parser(ToolParser):
    name: ClassVar[str] = "deepseek_v3"
    openers: ClassVar[tuple[str, ...]] = (CALLS_BEGIN, CALL_BEGIN)

    def __init__(
        self,
        parallel: bool = True,
        max_calls: int | None = None,
        schemas: Mapping[str, Any] | None = None,
        *,
        forced: bool = False,
    ) -> None:
        super().__init__(parallel, max_calls, schemas, forced=forced)
        self._head = ""  # what came before the separator: V3's type, or V3.1's name
        self._value = JsonScanner(CALL_END)

    def enter(self, opener: str) -> None:
        self.consume(len(opener))
        self.phase = "head" if opener == CALL_BEGIN else "between"

    def step_calls(self, final: bool, events: list[Event]) -> bool:
        if self.phase == "head":
            return self._read_head(final, events)
        if self.phase == "after_sep":
            return self._after_sep(final, events)
        if self.phase == "fence":
            return self._fence(final)
        if self.phase == "json":
            return self._json(final, events)
        if self.phase == "close":
            self.skip_space()
            if not self.buffer.startswith(FENCE) and FENCE.startswith(self.buffer) and self.buffer and not final:
                return False
            if self.buffer.startswith(FENCE):
                self.consume(len(FENCE))
            return self.past_close(CALL_END, final)
        if self.past_opener(CALL_BEGIN, final):
            self.phase = "head"
            return True
        return False

    def _read_head(self, final: bool, events: list[Event]) -> bool:
        at = self.buffer.find(SEP)
        if at < 0:
            if not final and len(self.buffer) <= _MAX_HEAD and "\n" not in self.buffer:
                return False
            return self.end_at(CALL_END, final, events)
        self._head = self.buffer[:at].strip()
        self.consume(at + len(SEP))
        self.phase = "after_sep"
        return True

    def _after_sep(self, final: bool, events: list[Event]) -> bool:
        """V3.1's arguments object, or V3's name up to its line's end (or its fence)."""
        rest = self.buffer.lstrip()
        if not rest and not final:
            return False
        if rest.startswith("{"):
            return self._start(self._head, "json", final, events)
        ends = [at for end in ("\n", FENCE, CALL_END) if (at := self.buffer.find(end)) >= 0]
        if not ends and not final and len(self.buffer) <= _MAX_HEAD:
            return False
        at = min(ends) if ends else len(self.buffer)
        name = self.buffer[:at].strip()
        if not name and rest.startswith(CALL_END):
            name = self._head  # V3.1's call without arguments
        elif _NAME.fullmatch(name):
            self.consume(at)
        return self._start(name, "fence", final, events)

    def _start(self, name: str, phase: str, final: bool, events: list[Event]) -> bool:
        if not _NAME.fullmatch(name):
            return self.end_at(CALL_END, final, events)
        self.start_call(name, events)
        self._value = JsonScanner(CALL_END)
        self.phase = phase
        return True

    def _fence(self, final: bool) -> bool:
        """V3's "```json" line before the arguments (forgiven when missing)."""
        self.skip_space()
        if not final and JSON_FENCE.startswith(self.buffer) and self.buffer != JSON_FENCE:
            return False
        for fence in (JSON_FENCE, FENCE):
            if self.buffer.startswith(fence):
                self.consume(len(fence))
                break
        self.phase = "json"
        return True

    def _json(self, final: bool, events: list[Event]) -> bool:
        self.skip_space()
        if not self.buffer and not final:
            return False
        if not self.buffer.startswith(("{", "[")):  # no arguments object: the call takes none
            return self.end_at(CALL_END, final, events)
        end = self._value.scan(self.buffer)
        stopped = self._value.stopped
        known = len(self.buffer) - held_prefix(self.buffer, (CALL_END,))  # less what may begin the call's end
        self.stream_arguments(
            self.buffer[: end if end is not None else stopped if stopped is not None else known], events
        )
        if end is None and stopped is None and not final:
            return False
        if end is None:  # cut short, or closed by the call's end before its JSON did: the call ends there
            return self.end_at(CALL_END, final, events)
        self.consume(end)
        self.close_call(None, events)
        self.phase = "close"
        return True


class DeepSeekV31Parser(DeepSeekV3Parser):
    name: ClassVar[str] = "deepseek_v31"
