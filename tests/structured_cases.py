"""JSON schemas, regexes and choice lists the structured-output tests run, and their checks.

Strings carry maxLength and arrays maxItems, so a small model's outputs complete (the grammar
ends them) within a modest max_tokens."""

from __future__ import annotations

import json
import re

import jsonschema

_NAME = {"type": "string", "minLength": 1, "maxLength": 12}
_SHORT = {"type": "string", "maxLength": 8}


def _obj(props: dict, required: list[str] | None = None, **extra) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


SCHEMAS: list[dict] = [
    _obj({"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    _obj({"city": _NAME, "population": {"type": "integer", "minimum": 1000, "maximum": 99999}}),
    _obj({"ok": {"type": "boolean"}}),
    _obj({"color": {"enum": ["red", "green", "blue"]}}),
    _obj(
        {
            "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 500},
        }
    ),
    _obj({"score": {"type": "number", "minimum": 0, "maximum": 10}}),
    _obj({"temperature": {"type": "integer", "minimum": -40, "maximum": 50}}),
    _obj({"tags": {"type": "array", "items": _SHORT, "minItems": 1, "maxItems": 3}}),
    _obj(
        {
            "ids": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 2,
                "maxItems": 4,
            }
        }
    ),  # fmt: skip
    _obj({"pair": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2}}),
    _obj({"person": _obj({"first": _NAME, "last": _NAME})}),
    _obj(
        {
            "book": _obj(
                {"title": _NAME, "year": {"type": "integer", "minimum": 1800, "maximum": 2024}}
            )
        }
    ),  # fmt: skip
    _obj({"a": _obj({"b": _obj({"c": {"type": "integer", "minimum": 0, "maximum": 99}})})}),
    _obj({"name": _NAME, "nickname": _NAME}, required=["name"]),
    _obj({"id": {"type": "integer", "minimum": 1, "maximum": 999}, "note": _SHORT}, ["id"]),
    _obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]}}),
    _obj({"value": {"anyOf": [{"type": "boolean"}, {"type": "string", "maxLength": 5}]}}),
    _obj(
        {
            "shape": {
                "anyOf": [
                    _obj({"radius": {"type": "integer", "minimum": 1, "maximum": 9}}),
                    _obj({"side": {"type": "integer", "minimum": 1, "maximum": 9}}),
                ]
            }
        }
    ),  # fmt: skip
    _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}}),
    _obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "state": {"enum": ["CA", "NY"]}}),
    _obj({"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}}),
    _obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}),
    _obj(
        {
            "items": {
                "type": "array",
                "maxItems": 2,
                "items": _obj(
                    {"name": _SHORT, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}
                ),
            }
        }
    ),  # fmt: skip
    _obj(
        {
            "matrix": {
                "type": "array",
                "minItems": 1,
                "maxItems": 2,
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 2,
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                },
            }
        }
    ),  # fmt: skip
    _obj({"status": {"const": "done"}, "steps": {"type": "integer", "minimum": 1, "maximum": 5}}),
    _obj(
        {
            "x": {"type": "integer", "minimum": 0, "maximum": 9},
            "y": {"type": "integer", "minimum": 0, "maximum": 9},
            "z": {"type": "integer", "minimum": 0, "maximum": 9},
        }
    ),  # fmt: skip
    _obj(
        {
            "answer": {"type": "string", "enum": ["yes", "no"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        }
    ),  # fmt: skip
    _obj({"level": {"type": "integer", "enum": [1, 2, 3]}}),
    _obj(
        {
            "user": _obj(
                {
                    "name": _NAME,
                    "roles": {"type": "array", "items": {"enum": ["admin", "dev"]}, "maxItems": 2},
                }
            )
        }
    ),  # fmt: skip
    {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 99},
        "minItems": 1,
        "maxItems": 3,
    },  # fmt: skip
    {"type": "string", "enum": ["alpha", "beta", "gamma"]},
    {"type": "integer", "minimum": 10, "maximum": 20},
    _obj(
        {
            "name": _NAME,
            "address": _obj(
                {"street": _NAME, "number": {"type": "integer", "minimum": 1, "maximum": 999}},
                ["street"],
            ),
        }
    ),  # fmt: skip
]

REGEXES: list[str] = [
    r"\d{3}-[a-z]{4}",
    r"(yes|no)",
    r"[A-Z][a-z]{2,6}",
    r"\d{4}-\d{2}-\d{2}",
    r"#[0-9a-f]{6}",
    r"(cat|dog|bird)s?",
    r"[0-9]{1,4}\.[0-9]{2}",
]

CHOICES: list[list[str]] = [
    ["positive", "negative", "neutral"],
    ["Paris", "London", "Berlin", "Madrid"],
    ["A", "B", "C", "D"],
]


def check_json(text: str, schema: dict) -> None:
    """The text parses as JSON and validates against the schema (raises otherwise)."""
    jsonschema.validate(json.loads(text), schema)


def check_regex(text: str, regex: str) -> None:
    assert re.fullmatch(regex, text), (regex, text)
