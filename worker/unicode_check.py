"""Strings that are not valid Unicode: JSON allows an escaped lone surrogate (\\ud800), no tokenizer does.

Checked once where a job enters, so every route refuses it with a 400 naming the field, instead of
failing deep inside tokenization.
"""

from __future__ import annotations

from typing import Any

from worker.openai.errors import BadRequest


def check_unicode(value: Any) -> None:
    """Raise BadRequest naming the first string (key or value) under `value` that holds a lone surrogate."""
    stack: list[tuple[Any, str | None]] = [(value, None)]  # None: the top, whose children are named bare
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            _check(item, path)
        elif isinstance(item, dict):
            for key, child in item.items():
                child_path = str(key) if path is None else f"{path}.{key}"
                _check(str(key), child_path)
                stack.append((child, child_path))
        elif isinstance(item, list):
            stack.extend((child, f"[{i}]" if path is None else f"{path}.[{i}]") for i, child in enumerate(item))


def _check(text: str, path: str | None) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        name = None if path is None else path.encode("utf-8", "backslashreplace").decode()  # a key may hold it
        raise BadRequest(
            f"{name if name is not None else 'the input'} is not valid Unicode: it holds an unpaired "
            "surrogate (a \\ud800-style escape without its pair)",
            param=name,
        ) from None
