"""Structured outputs on the request side: OpenAI's response_format, vLLM's structured_outputs and guided_* names,
SGLang's regex / ebnf / json_schema -> the engine's StructuredSpec, at most one constraint per request.

Every check that needs no compiler runs here (bad JSON, an empty choice list, schema keywords the grammar
engine would ignore); a regex or grammar that does not compile fails when the engine compiles it, before
the first token, with the same param.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from typing import Any

from engine.sample.structured.spec import StructuredSpec
from worker.openai.errors import BadRequest
from worker.openai.protocol import ResponseFormat, StructuredOutputs

# guided_decoding_backend values that name the grammar engine this worker runs (vLLM's "auto" picks it too).
BACKENDS = ("auto", "xgrammar")

Builder = Callable[[], StructuredSpec | None]


def structured_spec(
    *,
    response_format: ResponseFormat | None = None,
    structured_outputs: StructuredOutputs | None = None,
    guided_json: Any = None,
    guided_regex: str | None = None,
    guided_choice: list[str] | None = None,
    guided_grammar: str | None = None,
    guided_decoding_backend: str | None = None,
    guided_whitespace_pattern: str | None = None,
    regex: str | None = None,
    ebnf: str | None = None,
    json_schema: Any = None,
) -> StructuredSpec | None:
    """The request's one constraint (None: unconstrained). Raises BadRequest / InvalidRequest naming the param."""
    _check_backend(guided_decoding_backend, "guided_decoding_backend")
    _check_whitespace(guided_whitespace_pattern, "guided_whitespace_pattern")
    any_whitespace = True
    found: list[tuple[str, Builder]] = []
    if response_format is not None and response_format.type != "text":
        # any_whitespace is read when the spec is built, after structured_outputs may have turned it off.
        found.append(
            ("response_format", lambda: response_format_spec(response_format, "response_format", any_whitespace))
        )
    if structured_outputs is not None:
        so = structured_outputs
        _check_backend(so.backend, "structured_outputs.backend")
        _check_whitespace(so.whitespace_pattern, "structured_outputs.whitespace_pattern")
        any_whitespace = not so.disable_any_whitespace
        found += _structured_outputs(so, any_whitespace)
    for param, value, build in (
        ("guided_json", guided_json, lambda v, p: _schema(v, p, any_whitespace)),
        ("guided_regex", guided_regex, lambda v, p: StructuredSpec(kind="regex", value=v, param=p)),
        ("guided_choice", guided_choice, lambda v, p: StructuredSpec.choice(v, p)),
        ("guided_grammar", guided_grammar, lambda v, p: StructuredSpec(kind="grammar", value=v, param=p)),
        ("regex", regex, lambda v, p: StructuredSpec(kind="regex", value=v, param=p)),
        ("ebnf", ebnf, lambda v, p: StructuredSpec(kind="grammar", value=v, param=p)),
        ("json_schema", json_schema, lambda v, p: _schema(v, p, any_whitespace)),
    ):
        if value is not None:
            found.append((param, partial(build, value, param)))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(p for p, _ in found)
        raise BadRequest(
            f"only one structured output constraint is allowed per request, got {names}", param=found[1][0]
        )
    return found[0][1]()


def response_format_spec(fmt: ResponseFormat, param: str, any_whitespace: bool = True) -> StructuredSpec | None:
    """OpenAI's response_format: text (None), json_object (any JSON object) or json_schema (its `schema`)."""
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredSpec(kind="json_object", value="", any_whitespace=any_whitespace, param=param)
    if fmt.json_schema is None:
        raise BadRequest("response_format of type json_schema needs a json_schema object", param=param)
    schema = fmt.json_schema.schema_
    if schema is None:  # a named format without a schema: any JSON object, as json_object
        return StructuredSpec(kind="json_object", value="", any_whitespace=any_whitespace, param=param)
    return StructuredSpec.json_schema(schema, param, any_whitespace)


def _structured_outputs(so: StructuredOutputs, any_whitespace: bool) -> list[tuple[str, Builder]]:
    found: list[tuple[str, Builder]] = []
    p = "structured_outputs"
    if so.json_ is not None:
        found.append(
            (f"{p}.json", lambda: _schema(so.json_, f"{p}.json", any_whitespace, so.disable_additional_properties))
        )
    if (regex := so.regex) is not None:
        found.append((f"{p}.regex", lambda: StructuredSpec(kind="regex", value=regex, param=f"{p}.regex")))
    if so.choice is not None:
        found.append((f"{p}.choice", lambda: StructuredSpec.choice(so.choice, f"{p}.choice")))
    if (grammar := so.grammar) is not None:
        found.append((f"{p}.grammar", lambda: StructuredSpec(kind="grammar", value=grammar, param=f"{p}.grammar")))
    if so.json_object:
        found.append(
            (
                f"{p}.json_object",
                lambda: StructuredSpec(
                    kind="json_object", value="", any_whitespace=any_whitespace, param=f"{p}.json_object"
                ),
            )
        )
    if so.structural_tag is not None:
        found.append((f"{p}.structural_tag", lambda: _structural_tag(so.structural_tag, f"{p}.structural_tag")))
    return found


def _schema(value: Any, param: str, any_whitespace: bool, no_additional: bool = False) -> StructuredSpec:
    spec = StructuredSpec.json_schema(value, param, any_whitespace)
    if not no_additional:
        return spec
    return StructuredSpec.json_schema(_close_objects(json.loads(spec.value)), param, any_whitespace)


def _close_objects(schema: Any) -> Any:
    """disable_additional_properties: every object schema takes only the properties it lists."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ("items", "additionalItems"):
        if isinstance(out.get(key), dict):
            out[key] = _close_objects(out[key])
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(out.get(key), list):
            out[key] = [_close_objects(s) for s in out[key]]
    for key in ("properties", "$defs", "definitions"):
        if isinstance(out.get(key), dict):
            out[key] = {name: _close_objects(s) for name, s in out[key].items()}
    if out.get("type") == "object" or isinstance(out.get("properties"), dict):
        out["additionalProperties"] = False
    return out


def _structural_tag(value: Any, param: str) -> StructuredSpec:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return StructuredSpec(kind="structural_tag", value=text, param=param)


def _check_backend(value: str | None, param: str) -> None:
    if value is None:
        return
    name = value.split(":", 1)[0].strip()
    if name and name not in BACKENDS:
        raise BadRequest(
            f"{param} {value!r} is not available: this worker constrains outputs with xgrammar "
            f"(use one of {', '.join(BACKENDS)}, or leave it out)",
            param=param,
        )


def _check_whitespace(value: str | None, param: str) -> None:
    if value is not None:
        # xgrammar has no custom whitespace pattern; refused rather than ignored.
        raise BadRequest(
            f"{param} is not supported by the xgrammar backend; use disable_any_whitespace to "
            "generate JSON without free whitespace",
            param=param,
        )
