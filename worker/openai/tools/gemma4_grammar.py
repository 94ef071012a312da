"""The grammar a forced Gemma 4 call's arguments are held to: a tool's JSON schema written as an EBNF grammar
(xgrammar's dialect) over Gemma 4's argument syntax, `{key:value,...}` with `<|"|>`-quoted strings.

xgrammar's structural tags know JSON and a few XML styles, not this syntax, so the grammar is built here.
It writes what Gemma 4's template writes: no whitespace, bare keys, an object's properties in sorted order
(the template shows tools and past calls with sorted keys), only the listed properties (as xgrammar's strict
JSON schemas do), every required one.

What the grammar holds to:
- type (one or a list), properties, required, additionalProperties (false, or any value when an object lists
  no properties), items, minItems / maxItems, enum / const of strings, numbers, booleans and null, anyOf /
  oneOf, nullable; annotations (description, title, default, examples, $schema) are ignored.
- strings never contain `<|`, so no quote token can open inside one; a string with minLength / maxLength
  holds no `<` at all (its characters are counted one by one).
What it cannot hold to: numeric bounds, multipleOf, pattern and format (a value is then held to its type
alone), and everything else ($ref, allOf, patternProperties, ...; the arguments are then any object). Either
way a `strict` tool is a 400 naming the keyword, as the JSON formats' unenforceable schemas are.
"""

from __future__ import annotations

import json
from typing import Any

from worker.openai.errors import BadRequest
from worker.openai.tools.definitions import Tool

QUOTE = '<|"|>'
ANNOTATIONS = frozenset({"description", "title", "default", "examples", "$schema", "$comment", "deprecated"})
HELD = frozenset(
    {
        "type",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "minItems",
        "maxItems",
        "enum",
        "const",
        "anyOf",
        "oneOf",
        "nullable",
        "minLength",
        "maxLength",
    }
)
LOOSE = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "pattern", "format"})
BASE = r"""q ::= "<|\"|>"
text ::= ([^<] | "<"+ [^<|])* "<"*
integer ::= "-"? ("0" | [1-9] [0-9]*)
number ::= integer ("." [0-9]+)? ([eE] [+-]? [0-9]+)?
boolean ::= "true" | "false"
null ::= "null"
string ::= q text q
any ::= string | number | boolean | null | anyobject | anyarray
anyobject ::= "{" (key ":" any ("," key ":" any)*)? "}"
anyarray ::= "[" (any ("," any)*)? "]"
key ::= [A-Za-z_] [A-Za-z0-9_.\-]*
"""
ANY_ARGUMENTS = "root ::= anyobject\n" + BASE


class Unenforceable(Exception):
    """A schema keyword the grammar cannot hold a value to."""

    def __init__(self, keyword: str) -> None:
        super().__init__(keyword)
        self.keyword = keyword


def arguments_content(tool: Tool, index: int) -> dict[str, Any]:
    """The structural-tag content for one tool's arguments; an unenforceable schema is a 400 for a strict tool
    and any object for the others."""
    try:
        grammar = arguments_grammar(tool.parameters, bool(tool.strict))
    except Unenforceable as exc:
        if tool.strict:
            param = f"tools[{index}].function.parameters"
            raise BadRequest(
                f"{param}: Gemma 4's call grammar cannot enforce {exc.keyword!r}; a strict tool's "
                "arguments must be enforceable",
                param=param,
            ) from None
        grammar = ANY_ARGUMENTS
    return {"type": "grammar", "grammar": grammar}


def arguments_grammar(schema: dict[str, Any] | None, strict: bool = False) -> str:
    """The EBNF grammar (rule `root`) for arguments that fit `schema` (None: any object)."""
    if not schema:
        return ANY_ARGUMENTS
    rules = _Rules(strict)
    root = rules.value(schema)
    return f"root ::= {root}\n" + "".join(f"{name} ::= {body}\n" for name, body in rules.rules.items()) + BASE


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=True)


class _Rules:
    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.rules: dict[str, str] = {}

    def add(self, body: str) -> str:
        name = f"r{len(self.rules)}"
        self.rules[name] = body
        return name

    def value(self, schema: Any) -> str:
        """An expression for a value that fits `schema`."""
        if schema is True or schema == {}:
            return "any"
        if not isinstance(schema, dict):
            raise Unenforceable(json.dumps(schema))
        for keyword in schema:
            if keyword in LOOSE and self.strict or keyword not in HELD | LOOSE | ANNOTATIONS:
                raise Unenforceable(keyword)
        if "const" in schema or "enum" in schema:
            values = [schema["const"]] if "const" in schema else schema["enum"]
            if not isinstance(values, list) or not values:
                raise Unenforceable("enum")
            body = " | ".join(self.scalar(v) for v in values)
        elif "anyOf" in schema or "oneOf" in schema:
            options = schema.get("anyOf", schema.get("oneOf"))
            if not isinstance(options, list) or not options:
                raise Unenforceable("anyOf")
            body = " | ".join(self.value(option) for option in options)
        else:
            kinds = schema.get("type")
            if kinds is None:
                kinds = "object" if "properties" in schema else "array" if "items" in schema else None
            if kinds is None:
                return "any"
            body = " | ".join(self.typed(kind, schema) for kind in (kinds if isinstance(kinds, list) else [kinds]))
        if schema.get("nullable") is True:
            body += " | null"
        return self.add(body)

    def scalar(self, value: Any) -> str:
        if isinstance(value, str):
            if "<|" in value:
                raise Unenforceable("enum")
            return f"q {_literal(value)} q"
        if value is None or isinstance(value, (bool, int, float)):
            return _literal(json.dumps(value))
        raise Unenforceable("enum")

    def typed(self, kind: Any, schema: dict[str, Any]) -> str:
        if kind in ("integer", "number", "boolean", "null"):
            return kind
        if kind == "string":
            low, high = schema.get("minLength", 0), schema.get("maxLength")
            if not low and high is None:
                return "string"
            return f"q [^<]{{{int(low)},{'' if high is None else int(high)}}} q"
        if kind == "array":
            return self.array(schema)
        if kind == "object":
            return self.object(schema)
        raise Unenforceable(f"type {kind}")

    def array(self, schema: dict[str, Any]) -> str:
        item = self.value(schema.get("items", True))
        low, high = int(schema.get("minItems", 0)), schema.get("maxItems")
        if high is not None and int(high) == 0:
            return '"[" "]"'
        more = f"{{{max(low - 1, 0)},{'' if high is None else int(high) - 1}}}"
        body = f'{item} ("," {item}){more}'
        return f'"[" {body} "]"' if low else f'"[" ({body})? "]"'

    def object(self, schema: dict[str, Any]) -> str:
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties", True)
        if not isinstance(properties, dict) or (isinstance(extra, dict) and extra):
            raise Unenforceable("additionalProperties" if isinstance(extra, dict) else "properties")
        if not properties:
            return "anyobject" if extra is not False else '"{" "}"'
        if any(":" in key or "<|" in key for key in properties):
            raise Unenforceable("properties")
        required = set(schema.get("required") or ())
        members = [
            (f"{_literal(key + ':')} {self.value(properties[key])}", key in required) for key in sorted(properties)
        ]
        # first: the members from here on, the first one written without a comma; after: each after a comma.
        first, after = '""', '""'
        for member, needed in reversed(members):
            first, after = (
                self.add(f"{member} {after}" if needed else f"{member} {after} | {first}"),
                self.add(f'"," {member} {after}' if needed else f'("," {member})? {after}'),
            )
        return f'"{{" {first} "}}"'
