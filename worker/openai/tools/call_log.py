"""CallLog: the calls one answer has made, to tell whether the call being written repeats one of them.

A small model forced to call tools at temperature 0 writes the same call again and again until max_tokens
or the context's end. A call with the same name and arguments as an earlier one of the same answer ends
the answer instead (worker/openai/tools/parser.py). Arguments compare as written, less the whitespace
between JSON tokens, so a prefix of a call can already be told apart while it streams.
"""

from __future__ import annotations

JSON_SPACE = " \t\r\n"


def compact(arguments: str) -> str:
    """The arguments text without whitespace outside strings (of a prefix: a prefix of the whole's)."""
    out = []
    in_string = escaped = False
    for c in arguments:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in JSON_SPACE:
            continue
        out.append(c)
    return "".join(out)


class CallLog:
    """The (name, compact arguments) of each call an answer has made."""

    def __init__(self) -> None:
        self._calls: list[tuple[str, str]] = []

    def add(self, name: str, arguments: str) -> None:
        self._calls.append((name, compact(arguments)))

    def may_repeat(self, name: str, written: str) -> bool:
        """Whether a call of `name` whose arguments begin with `written` can still turn out to be a repeat."""
        head = compact(written)
        return any(n == name and arguments.startswith(head) for n, arguments in self._calls)

    def repeats(self, name: str, arguments: str) -> bool:
        return (name, compact(arguments)) in self._calls
