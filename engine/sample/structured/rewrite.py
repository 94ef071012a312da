"""Schema rewrites before xgrammar compiles a JSON schema: same language, a grammar it handles better.

A string with minLength / maxLength becomes the equivalent `pattern`. NOTE: xgrammar 0.2.8 matches a length
bound by counting repetitions at run time, which costs milliseconds per row and step inside such a string
(and its character class lets raw control characters into the JSON); a pattern is a finite automaton whose
token masks are precomputed at compile time: about 500 times cheaper to fill (bench/RESULTS.md).
"""

from __future__ import annotations

from typing import Any

# A character a JSON string may hold unescaped (the length bound then counts characters, as JSON Schema does).
PLAIN_CHAR = '[^\\x00-\\x1f"\\\\]'
# Where a schema keeps sub-schemas, by the shape of the value: one schema, a list, or a map of them.
ONE = ("items", "additionalProperties", "additionalItems")
MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
MAP = ("properties", "$defs", "definitions")


def lengths_as_patterns(schema: Any) -> Any:
    """A copy of `schema` with every length-bounded string (no pattern, format, enum or const) as a pattern."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ONE:
        if isinstance(out.get(key), dict):
            out[key] = lengths_as_patterns(out[key])
    for key in MANY:
        if isinstance(out.get(key), list):
            out[key] = [lengths_as_patterns(s) for s in out[key]]
    for key in MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: lengths_as_patterns(s) for name, s in out[key].items()}
    types = out.get("type")
    is_string = types == "string" or (isinstance(types, list) and "string" in types)
    bounded = "minLength" in out or "maxLength" in out
    if is_string and bounded and not any(k in out for k in ("pattern", "format", "enum", "const")):
        low = int(out.pop("minLength", 0))
        high = out.pop("maxLength", None)
        out["pattern"] = f"^{PLAIN_CHAR}{{{low},{'' if high is None else int(high)}}}$"
    return out
