"""JSON schemas that structured-output checks and bench.structured hold outputs to: each with the
prompt that asks for it. Between them they use nested objects, arrays with min/max items, enums,
consts, numbers with ranges, strings with patterns, lengths and formats, anyOf, $defs/$ref,
optional properties and closed objects."""

from __future__ import annotations

_NAME = {"type": "string", "minLength": 1, "maxLength": 24}
_ADDRESS = {
    "type": "object",
    "properties": {"street": _NAME, "city": _NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
    "required": ["city", "zip"],
    "additionalProperties": False,
}


def _obj(props: dict, required: list[str] | None = None, **extra) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


SCHEMAS: list[tuple[str, dict]] = [
    ("a person", _obj({"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("a book", _obj({"title": _NAME, "author": _NAME, "year": {"type": "integer", "minimum": 1450, "maximum": 2030}})),
    ("a color", _obj({"name": _NAME, "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}})),
    ("a city", _obj({"city": _NAME, "country": _NAME, "population": {"type": "integer", "minimum": 0}})),
    ("a to-do list", _obj({"items": {"type": "array", "items": _NAME, "minItems": 1, "maxItems": 4}})),
    ("a rating", _obj({"stars": {"type": "integer", "minimum": 1, "maximum": 5}, "comment": _NAME})),
    (
        "the weather",
        _obj(
            {
                "temperature": {"type": "number", "minimum": -60, "maximum": 60},
                "sky": {"enum": ["sunny", "cloudy", "rain", "snow"]},
            }
        ),
    ),
    ("a yes/no answer", _obj({"answer": {"type": "boolean"}, "reason": _NAME})),
    (
        "a product",
        _obj(
            {
                "name": _NAME,
                "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 10000},
                "currency": {"enum": ["USD", "EUR", "GBP"]},
            }
        ),
    ),
    ("a point", _obj({"x": {"type": "number"}, "y": {"type": "number"}})),
    ("an address", _ADDRESS),
    ("a user with an address", _obj({"user": _NAME, "address": _ADDRESS})),
    (
        "a shopping cart",
        _obj(
            {
                "lines": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": _obj(
                        {
                            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                            "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                        }
                    ),
                }
            }
        ),
    ),
    ("an event", _obj({"title": _NAME, "date": {"type": "string", "format": "date"}})),
    ("a login", _obj({"email": {"type": "string", "format": "email"}, "remember": {"type": "boolean"}})),
    (
        "a pet",
        _obj(
            {
                "name": _NAME,
                "species": {"enum": ["cat", "dog", "bird"]},
                "age": {"type": "integer", "minimum": 0, "maximum": 30},
            },
            required=["name", "species"],
        ),
    ),
    (
        "a movie",
        _obj(
            {
                "title": _NAME,
                "genres": {
                    "type": "array",
                    "items": {"enum": ["drama", "comedy", "action"]},
                    "minItems": 1,
                    "maxItems": 2,
                },
            }
        ),
    ),
    (
        "a shape",
        {
            "anyOf": [
                _obj({"kind": {"const": "circle"}, "radius": {"type": "number", "minimum": 0}}),
                _obj({"kind": {"const": "square"}, "side": {"type": "number", "minimum": 0}}),
            ]
        },
    ),
    (
        "an id",
        _obj({"id": {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "string", "pattern": "^[a-z]{4}$"}]}}),
    ),
    (
        "a tree",
        {
            "$defs": {"leaf": _obj({"value": {"type": "integer", "minimum": 0, "maximum": 99}})},
            **_obj(
                {
                    "root": {"$ref": "#/$defs/leaf"},
                    "children": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/leaf"}},
                }
            ),
        },
    ),
    (
        "a team",
        {
            "$defs": {"member": _obj({"name": _NAME, "role": {"enum": ["lead", "dev", "qa"]}})},
            **_obj(
                {
                    "team": _NAME,
                    "members": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"$ref": "#/$defs/member"}},
                }
            ),
        },
    ),
    (
        "a setting",
        _obj(
            {
                "key": {"type": "string", "pattern": "^[a-z_]{1,16}$"},
                "value": {"anyOf": [{"type": "boolean"}, {"type": "integer"}, {"type": "null"}]},
            }
        ),
    ),
    (
        "a version",
        _obj(
            {
                "major": {"type": "integer", "minimum": 0, "maximum": 99},
                "minor": {"type": "integer", "minimum": 0, "maximum": 99},
                "tag": _NAME,
            },
            required=["major", "minor"],
        ),
    ),
    (
        "a greeting",
        _obj(
            {
                "text": {"type": "string", "minLength": 2, "maxLength": 40},
                "language": {"enum": ["en", "fr", "de", "es"]},
            }
        ),
    ),
    (
        "coordinates",
        _obj(
            {
                "lat": {"type": "number", "minimum": -90, "maximum": 90},
                "lon": {"type": "number", "minimum": -180, "maximum": 180},
            }
        ),
    ),
    (
        "a score table",
        _obj(
            {
                "scores": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 4,
                    "items": {"type": "integer", "minimum": 0, "maximum": 100},
                }
            }
        ),
    ),
    (
        "a recipe",
        _obj(
            {
                "dish": _NAME,
                "steps": {"type": "array", "minItems": 1, "maxItems": 3, "items": _NAME},
                "vegan": {"type": "boolean"},
            }
        ),
    ),
    ("a flag", _obj({"enabled": {"const": True}, "owner": _NAME})),
    ("a phone", _obj({"number": {"type": "string", "pattern": "^\\+[0-9]{6,12}$"}})),
    (
        "a note",
        _obj(
            {"title": _NAME, "body": {"type": "string", "maxLength": 60}, "pinned": {"type": "boolean"}},
            required=["title"],
        ),
    ),
    ("an answer", {"type": "integer", "minimum": 0, "maximum": 1000}),
    (
        "a list of words",
        {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,8}$"}, "minItems": 1, "maxItems": 4},
    ),
]


def prompt(what: str) -> list[dict]:
    return [
        {"role": "system", "content": "You answer with JSON only."},
        {"role": "user", "content": f"Describe {what} as JSON."},
    ]
