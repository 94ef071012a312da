"""`truncation: "auto"` on /v1/responses: the oldest whole turns go until the prompt fits the context.

A turn is a user message and what follows it up to the next user message (the answer, its calls and their
results), so what is kept still starts with a user message, as templates that enforce alternation require,
and no tool result loses its call. System messages (instructions, developer items) always stay. The number
of turns to drop is found by bisection: n turns are rendered about log2(n) + 2 times, not up to n times.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

Rendered = TypeVar("Rendered")


def turn_starts(messages: list[dict[str, Any]]) -> list[int]:
    """Where each turn begins: the first message that is not a system message, then every later user message."""
    first = next((i for i, m in enumerate(messages) if m["role"] != "system"), None)
    if first is None:
        return []
    return [first, *(i for i, m in enumerate(messages) if i > first and m["role"] == "user")]


def without_turns_before(messages: list[dict[str, Any]], start: int) -> list[dict[str, Any]]:
    """The system messages and everything from `start` on."""
    return [m for i, m in enumerate(messages) if i >= start or m["role"] == "system"]


def fit_turns(
    messages: list[dict[str, Any]], render: Callable[[list[dict[str, Any]]], Rendered], fits: Callable[[Rendered], bool]
) -> Rendered:
    """The rendering that keeps the most recent whole turns that fit. When even the last turn alone does not
    fit, its rendering is returned anyway: the engine refuses it as too long, naming the input."""
    starts = turn_starts(messages)
    renders: dict[int, Rendered] = {}

    def kept(k: int) -> Rendered:  # k: how many of the oldest turns are dropped
        if k not in renders:
            renders[k] = render(without_turns_before(messages, starts[k]) if k else messages)
        return renders[k]

    if len(starts) < 2 or fits(kept(0)):
        return kept(0)
    failing, fitting = 0, len(starts) - 1
    if not fits(kept(fitting)):
        return kept(fitting)
    # NOTE: dropping more turns never lengthens the prompt, so "fits" is monotonic in k.
    while fitting - failing > 1:
        middle = (failing + fitting) // 2
        if fits(kept(middle)):
            fitting = middle
        else:
            failing = middle
    return kept(fitting)
