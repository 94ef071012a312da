"""Gemma 4's argument syntax read into JSON text as it arrives.

Gemma 4 writes a call's arguments as `{key:value,...}`: keys bare (or, rarely, quoted), strings between the
`<|"|>` quote token and never escaped inside, numbers, `true` / `false` / `null` bare, objects and arrays
nested. `ArgumentsReader.read(text)` turns the text from the arguments' `{` on into JSON, appending only:
a piece of JSON is written once the markup that fixes it has been read (a key at its `:`, a bare value at
the `,` / `}` / `]` after it, string characters as soon as they cannot be the start of the closing quote).
So the JSON known after any prefix is a prefix of the whole text's JSON, and reading a text in one piece
or in any split gives the same JSON.
"""

from __future__ import annotations

import json
import re

QUOTE = '<|"|>'
_SPACE = " \t\r\n"
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_LOOSE_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_MAX_KEY = 256  # a bare key this long without its `:` is no key


def bare_value(text: str) -> str:
    """The JSON for a bare (unquoted) value: a literal, a number, else the text as a string."""
    text = text.strip()
    if text in ("true", "false", "null"):
        return text
    if _NUMBER.fullmatch(text):
        return text
    if _LOOSE_NUMBER.fullmatch(text):  # `+1`, `1.`, `.5`: numbers JSON spells otherwise
        value = float(text)
        return json.dumps(int(value) if value.is_integer() and "." not in text and "e" not in text.lower() else value)
    return json.dumps(text, ensure_ascii=False)


class ArgumentsReader:
    """Reads one call's arguments from their opening `{`, each time more of the text has arrived.

    `json` is the JSON written so far; `end` the index just past the closing `}` once read; `broken` is set
    when the text stops following the syntax (the JSON then stays as it was).
    """

    def __init__(self) -> None:
        self.pos = 0
        self.out: list[str] = []
        self.stack: list[str] = []  # "{" or "[" for each open container
        self.expect = "value"  # value | key | colon | comma | string (inside a quoted value) | qkey
        self.first = True  # the open container has no member yet
        self.end: int | None = None
        self.broken = False
        self._key: list[str] = []

    @property
    def json(self) -> str:
        return "".join(self.out)

    def read(self, text: str, final: bool = False) -> str:
        """Read `text` (the whole arguments text so far, from the `{`); returns the JSON known so far."""
        while self.end is None and not self.broken and self.pos < len(text):
            if not self._step(text, final):
                break
        return self.json

    def _step(self, text: str, final: bool) -> bool:
        """Read one piece at `pos`; False when the rest must wait for more text."""
        if self.expect == "string":
            return self._string(text, final)
        c = text[self.pos]
        if c in _SPACE:
            self.pos += 1
            return True
        if self.expect == "value":
            return self._value(text, final)
        if self.expect == "key":
            return self._key_start(text, final)
        if self.expect == "qkey":
            at = text.find(QUOTE, self.pos)
            if at < 0:
                return False
            self._emit_key(text[self.pos : at], at + len(QUOTE))
            return True
        if self.expect == "colon":
            return self._advance(c == ":", "value", 1)
        # comma: a member ended; a `,` or the container's close follows
        if c == ",":
            self.pos += 1
            self.expect = "key" if self.stack[-1] == "{" else "value"
            self.out.append(", ")
            return True
        return self._close(c)

    def _advance(self, ok: bool, expect: str, n: int) -> bool:
        if not ok:
            self.broken = True
            return False
        self.pos += n
        self.expect = expect
        return True

    def _value(self, text: str, final: bool) -> bool:
        c = text[self.pos]
        if c in "{[":
            self.stack.append(c)
            self.out.append(c)
            self.pos += 1
            self.expect = "key" if c == "{" else "value"
            self.first = True
            return True
        if c == "]" and self.stack and self.stack[-1] == "[" and self.first:
            return self._close(c)  # an empty array
        if text.startswith(QUOTE, self.pos):
            self.pos += len(QUOTE)
            self.out.append('"')
            self.expect = "string"
            return True
        if QUOTE.startswith(text[self.pos :]) and not final:
            return False
        if not self.stack:
            self.broken = True  # the arguments are an object, nothing else
            return False
        return self._bare(text, final)

    def _bare(self, text: str, final: bool) -> bool:
        stop = min((i for i in (text.find(ch, self.pos) for ch in ",}]") if i >= 0), default=-1)
        if stop < 0:
            if not final:
                return False
            stop = len(text)
        raw = text[self.pos : stop]
        if not raw.strip() or QUOTE in raw or "{" in raw or "[" in raw:
            self.broken = True
            return False
        self.out.append(bare_value(raw))
        self.pos = stop
        self.expect = "comma"
        self.first = False
        return True

    def _string(self, text: str, final: bool) -> bool:
        at = text.find(QUOTE, self.pos)
        if at >= 0:
            self._chars(text[self.pos : at])
            self.out.append('"')
            self.pos = at + len(QUOTE)
            self.expect = "comma"
            self.first = False
            return True
        rest = text[self.pos :]
        keep = (
            0
            if final
            else next((n for n in range(min(len(QUOTE) - 1, len(rest)), 0, -1) if rest.endswith(QUOTE[:n])), 0)
        )
        self._chars(rest[: len(rest) - keep])
        self.pos += len(rest) - keep
        return False

    def _chars(self, chars: str) -> None:
        if chars:
            self.out.append(json.dumps(chars, ensure_ascii=False)[1:-1])

    def _key_start(self, text: str, final: bool) -> bool:
        c = text[self.pos]
        if c == "}" and self.first:
            return self._close(c)  # an empty object
        if text.startswith(QUOTE, self.pos):
            self.pos += len(QUOTE)
            self.expect = "qkey"
            return True
        if QUOTE.startswith(text[self.pos :]) and not final:
            return False
        colon = text.find(":", self.pos)
        stops = [i for i in (text.find(ch, self.pos) for ch in ",{}[]") if i >= 0]
        if colon < 0 or (stops and min(stops) < colon):
            if stops or final or len(text) - self.pos > _MAX_KEY:
                self.broken = True  # a member without a key
            return False
        key = text[self.pos : colon].strip()
        if not key:
            self.broken = True
            return False
        self._emit_key(key, colon + 1)
        return True

    def _emit_key(self, key: str, after: int) -> None:
        self.out.append(json.dumps(key, ensure_ascii=False) + ": ")
        self.pos = after
        self.expect = "colon" if self.expect == "qkey" else "value"

    def _close(self, c: str) -> bool:
        if not self.stack or c != {"{": "}", "[": "]"}[self.stack[-1]]:
            self.broken = True
            return False
        self.stack.pop()
        self.out.append(c)
        self.pos += 1
        self.expect = "comma"
        self.first = False
        if not self.stack:
            self.end = self.pos
        return True
