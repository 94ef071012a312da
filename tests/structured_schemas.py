"""JSON schemas that structured-output tests generate against (engine and worker alike).

Every string has a maxLength, every array a maxItems and every number a range, so that even a random-weight
model, whose logits favour no closing quote, must finish inside a bounded number of tokens: then each output
can be held to the schema, whole.
"""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 12}
SHORT = {"type": "string", "maxLength": 8}

SCHEMAS: dict[str, dict] = {
    "flat_object": {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested_objects": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": NAME,
                    "address": {
                        "type": "object",
                        "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["person"],
        "additionalProperties": False,
    },
    "array_min_max_items": {
        "type": "array",
        "items": {"type": "integer", "minimum": -9, "maximum": 99},
        "minItems": 2,
        "maxItems": 4,
    },
    "string_enum": {"type": "string", "enum": ["red", "green", "blue"]},
    "mixed_enum": {"enum": ["yes", 0, True, None, "no way"]},
    "required_subset": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "note": SHORT,
            "flag": {"type": "boolean"},
        },
        "required": ["id"],
        "additionalProperties": False,
    },
    "any_of": {
        "type": "object",
        "properties": {"value": {"anyOf": [SHORT, {"type": "integer", "minimum": 0, "maximum": 50}]}},
        "required": ["value"],
        "additionalProperties": False,
    },
    "ref_defs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -5, "maximum": 5},
                    "y": {"type": "integer", "minimum": -5, "maximum": 5},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "segment": {
                "type": "object",
                "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
                "required": ["start", "end"],
                "additionalProperties": False,
            },
        },
        "$ref": "#/$defs/segment",
    },
    "definitions_ref": {
        "definitions": {"color": {"type": "string", "enum": ["cyan", "magenta"]}},
        "type": "object",
        "properties": {"primary": {"$ref": "#/definitions/color"}},
        "required": ["primary"],
        "additionalProperties": False,
    },
    "number_range": {
        "type": "object",
        "properties": {
            "temperature": {"type": "number", "minimum": -40.5, "maximum": 60.25},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["temperature", "ratio"],
        "additionalProperties": False,
    },
    "integer_exclusive_range": {
        "type": "integer",
        "exclusiveMinimum": 10,
        "exclusiveMaximum": 20,
    },
    "string_pattern": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    "additional_properties_false": {
        "type": "object",
        "properties": {"a": SHORT, "b": {"type": "integer", "minimum": 0, "maximum": 9}, "c": {"type": "null"}},
        "additionalProperties": False,
    },
    "booleans_and_null": {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "nothing": {"type": "null"}},
        "required": ["ok", "nothing"],
        "additionalProperties": False,
    },
    "type_list": {
        "type": "object",
        "properties": {"maybe": {"type": ["string", "null"], "maxLength": 6}},
        "required": ["maybe"],
        "additionalProperties": False,
    },
    "const": {
        "type": "object",
        "properties": {"version": {"const": 2}, "kind": {"const": "event"}},
        "required": ["version", "kind"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array",
        "minItems": 1,
        "maxItems": 3,
        "items": {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[a-z]{3}[0-9]$"},
                "qty": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["sku", "qty"],
            "additionalProperties": False,
        },
    },
    "string_lengths": {"type": "string", "minLength": 3, "maxLength": 5},
    "tuple_prefix_items": {
        "type": "array",
        "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9}, SHORT, {"type": "boolean"}],
        "items": False,
    },
    "matrix": {
        "type": "array",
        "minItems": 2,
        "maxItems": 2,
        "items": {
            "type": "array",
            "minItems": 2,
            "maxItems": 2,
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
        },
    },
    "one_of_disjoint": {
        "type": "object",
        "properties": {"answer": {"oneOf": [{"type": "boolean"}, {"type": "string", "enum": ["unknown"]}]}},
        "required": ["answer"],
        "additionalProperties": False,
    },
    "formats": {
        "type": "object",
        "properties": {"day": {"type": "string", "format": "date"}},
        "required": ["day"],
        "additionalProperties": False,
    },
    "integer_multiple_of": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100},
}
