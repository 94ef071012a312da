"""StructuredSpec: one request's grammar constraint as plain data (what to match, never a compiled object).

The spec travels inside SamplingParams; engine.sample.structured.compiler turns it into an xgrammar grammar. Checks
that need no compiler (JSON that does not parse, an empty choice list, schema keywords xgrammar would
silently ignore) run here, when the spec is built, so they fail before the request reaches the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.config import JSON_MAX_WHITESPACE  # noqa: F401 (the compiler's and the worker's default)
from engine.errors import InvalidRequest
from engine.sample.structured.rewrite import MANY, MAP, ONE

Kind = Literal["json", "json_object", "regex", "choice", "grammar", "structural_tag"]
KINDS: tuple[str, ...] = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")

# Keywords xgrammar 0.2 compiles without enforcing them: an output could break them while the request
# believed it was constrained. Refused rather than dropped (vLLM falls back to llguidance for most of these).
UNSUPPORTED_KEYWORDS = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "propertyNames",
        "patternProperties",
        "unevaluatedProperties",
        "unevaluatedItems",
        "contains",
        "minContains",
        "maxContains",
        "$dynamicRef",
        "$recursiveRef",
    }
)


@dataclass(frozen=True, kw_only=True)
class StructuredSpec:
    """What the output must match. `value` is text: a JSON schema, a regex, an EBNF grammar, a JSON list of
    choices or a structural tag, as the kind says; `param` names the request field it came from (for errors).

    `prefix`, when set, is a structural tag's format (JSON text) that the output matches first, and the constraint
    holds from its end on: the reasoning a thinking model writes before its answer.
    """

    kind: Kind
    value: str = ""
    any_whitespace: bool = True
    param: str = field(default="structured_outputs", compare=False)
    prefix: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequest(f"unknown constraint kind {self.kind!r} (one of {', '.join(KINDS)})", param=self.param)
        if not isinstance(self.value, str):
            raise InvalidRequest(f"{self.param} must be text", param=self.param)
        if self.kind == "json":
            check_schema(parse_json(self.value, self.param), self.param)
        elif self.kind == "choice":
            choices = parse_json(self.value, self.param)
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
                raise InvalidRequest(f"{self.param} must be a non-empty list of strings", param=self.param)
        elif self.kind == "structural_tag":
            parse_json(self.value, self.param)
        elif self.kind in ("regex", "grammar") and not self.value:
            raise InvalidRequest(f"{self.param} must not be empty", param=self.param)
        if self.prefix:
            parse_json(self.prefix, self.param)

    @property
    def key(self) -> tuple[str, str, bool, str]:
        """What the compiled grammar depends on (the compile cache's key)."""
        return (self.kind, self.value, self.any_whitespace, self.prefix)

    @classmethod
    def json_schema(cls, schema: Any, param: str, any_whitespace: bool = True) -> StructuredSpec:
        """From a schema sent as an object or as JSON text."""
        if isinstance(schema, str):
            schema = parse_json(schema, param)
        if isinstance(schema, bool):  # true: any JSON value; false: nothing can match
            if not schema:
                raise InvalidRequest(f"{param}: the schema false matches nothing", param=param)
            schema = {}
        if not isinstance(schema, dict):
            raise InvalidRequest(f"{param} must be a JSON schema object, got {type(schema).__name__}", param=param)
        # Key order is kept: it is the order the properties are generated in.
        return cls(
            kind="json", value=json.dumps(schema, ensure_ascii=False), any_whitespace=any_whitespace, param=param
        )

    @classmethod
    def choice(cls, choices: Any, param: str) -> StructuredSpec:
        if not isinstance(choices, (list, tuple)):
            raise InvalidRequest(f"{param} must be a non-empty list of strings", param=param)
        return cls(kind="choice", value=json.dumps(list(choices), ensure_ascii=False), any_whitespace=True, param=param)


def parse_json(text: str, param: str) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"{param} is not valid JSON: {exc}", param=param) from None


def check_schema(schema: Any, param: str, path: str = "#") -> None:
    """Raise InvalidRequest naming the first keyword xgrammar cannot enforce (walking sub-schemas only, so a
    property that happens to be called "not" is fine)."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{param}: the schema at {path} must be an object or a boolean", param=param)
    for key, value in schema.items():
        if key in UNSUPPORTED_KEYWORDS:
            raise InvalidRequest(f"{param}: the JSON schema keyword {key!r} (at {path}) is not supported", param=param)
        if key == "uniqueItems" and value is True:
            raise InvalidRequest(
                f"{param}: the JSON schema keyword 'uniqueItems' (at {path}) is not supported", param=param
            )
        if key == "multipleOf" and not (isinstance(value, int) and schema.get("type") == "integer"):
            # xgrammar enforces multipleOf for integers only.
            raise InvalidRequest(f"{param}: 'multipleOf' (at {path}) is supported for integers only", param=param)
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            # xgrammar does not intersect several sub-schemas; one (a wrapped $ref) is fine.
            raise InvalidRequest(
                f"{param}: 'allOf' with more than one schema (at {path}) is not supported", param=param
            )
        if key in ("minLength", "maxLength") and ("pattern" in schema or "format" in schema):
            # xgrammar matches the pattern or format alone and drops the bound.
            raise InvalidRequest(
                f"{param}: {key!r} together with 'pattern' or 'format' (at {path}) is not supported", param=param
            )
        if key in ONE and isinstance(value, (dict, bool)):
            check_schema(value, param, f"{path}/{key}")
        elif key in MANY and isinstance(value, list):
            for i, sub in enumerate(value):
                check_schema(sub, param, f"{path}/{key}/{i}")
        elif key in MAP and isinstance(value, dict):
            for name, sub in value.items():
                check_schema(sub, param, f"{path}/{key}/{name}")
