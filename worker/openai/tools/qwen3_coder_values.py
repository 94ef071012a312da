"""Qwen3-Coder's parameter values typed into JSON by the tool's schema.

Each value is the raw text between `<parameter=KEY>` and `</parameter>` (less one newline either side). A
parameter whose schema says string, or that the schema does not list, keeps its text as a JSON string; a value of
an enum or const is the listed value less the whitespace around it (the call grammar allows whitespace there); one
of another type (integer, number, boolean, null, object, array) is read as JSON (or as the Python literal small
models sometimes write: `True`, `{'a': 1}`), and stays a string when it reads as none of its types and a string
is allowed, or cannot be read at all. vLLM's and SGLang's `qwen3_coder` parsers convert values the same way.
"""

from __future__ import annotations

import ast
import json
from typing import Any

# Type names the models (and some clients' schemas) use for text.
STRING_TYPES = frozenset({"string", "str", "text", "varchar", "char", "enum"})
_UNREAD = object()
_PYTHON_TYPES: dict[str, tuple[type, ...]] = {
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


def parameter_schema(schemas: Any, tool: str, key: str) -> Any:
    """The schema of parameter `key` of tool `tool` among the request's tools' parameters schemas (None: unknown)."""
    parameters = schemas.get(tool) if hasattr(schemas, "get") else None
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    return properties.get(key) if isinstance(properties, dict) else None


def schema_types(schema: Any) -> set[str]:
    """The JSON types a parameter's schema allows (empty: it does not say)."""
    if not isinstance(schema, dict):
        return set()
    kinds = schema.get("type")
    if isinstance(kinds, str):
        return {kinds}
    if isinstance(kinds, list):
        return {k for k in kinds if isinstance(k, str)}
    out: set[str] = set()
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or ():
            out |= schema_types(option)
    if out:
        return out
    values = _choices(schema)
    if values:
        return {_type_of(v) for v in values}
    if "properties" in schema:
        return {"object"}
    if "items" in schema:
        return {"array"}
    return set()


def is_text(schema: Any) -> bool:
    """Whether a value of this parameter is its text as written (a string, or a parameter the schema leaves out),
    so that it can stream as it comes. A choice of values (enum, const) is not: it is known at its end."""
    kinds = schema_types(schema)
    return (not kinds or kinds <= STRING_TYPES) and not _choices(schema)


def typed_value(raw: str, schema: Any) -> str:
    """The JSON text for a parameter's raw value."""
    choices = _choices(schema)
    if choices:  # a listed value, less the whitespace around it (which the call grammar allows there)
        value = raw.strip()
        read = _read(value)
        for candidate in (value, read):
            if any(candidate == c and type(candidate) is type(c) for c in choices):
                return json.dumps(candidate, ensure_ascii=False)
    kinds = schema_types(schema)
    if not kinds or kinds <= STRING_TYPES:
        return json.dumps(raw, ensure_ascii=False)
    value = _read(raw.strip())
    if value is not _UNREAD and any(_fits(value, kind) for kind in kinds):
        return json.dumps(value, ensure_ascii=False)
    if value is _UNREAD or kinds & STRING_TYPES:
        return json.dumps(raw, ensure_ascii=False)
    return json.dumps(value, ensure_ascii=False)  # a value of another type than declared: as the model wrote it


def _choices(schema: Any) -> list[Any]:
    if not isinstance(schema, dict):
        return []
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    return values if isinstance(values, list) else []


def _read(text: str) -> Any:
    try:
        return json.loads(text, parse_constant=_no_constant)
    except ValueError:
        pass
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    try:
        value = ast.literal_eval(text)
        json.dumps(value, allow_nan=False)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _UNREAD
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _fits(value: Any, kind: str) -> bool:
    if kind == "null":
        return value is None
    if kind in STRING_TYPES:
        return isinstance(value, str)
    types = _PYTHON_TYPES.get(kind)
    if types is None or (isinstance(value, bool) and kind != "boolean"):
        return False
    return isinstance(value, types)


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, dict):
        return "object"
    return "array" if isinstance(value, list) else "string"
