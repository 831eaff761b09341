"""A JSON schema that no finite value matches is found (a $ref cycle with no way out), one with a way out is not."""
from __future__ import annotations

import pytest

from engine.processing.json_schema_check import MAX_REFS, unmatchable_schema

NODE = {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}, "required": ["next"]}


@pytest.mark.parametrize("schema", [
    {},
    {"type": "object"},
    {"properties": {"a": {"type": "string"}}},  # no type: an object is one of its values
    {"type": "object", "properties": {"me": {"$ref": "#"}}},  # optional: {} ends it
    {"type": "object", "properties": {"me": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["me"]},
    {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"]},
    {"type": "object", "properties": {"n": {"$ref": "#/$defs/a"}}, "required": ["n"], "$defs": {
        "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
        "b": {"type": ["object", "string"], "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}}},
    {"type": "object", "properties": {"x": {"$ref": "https://example.com/s.json"}}, "required": ["x"]},  # not ours
    {"type": "string"},
])
def test_schemas_with_a_finite_value_pass(schema: dict) -> None:
    assert unmatchable_schema(schema) is None


@pytest.mark.parametrize(("schema", "words"), [
    ({"type": "object", "properties": {"me": {"$ref": "#"}}, "required": ["me"]}, "$ref '#'"),
    ({"type": "object", "properties": {"n": {"$ref": "#/$defs/node"}}, "required": ["n"], "$defs": {"node": NODE}},
     "$ref '#/$defs/node'"),
    ({"type": "object", "properties": {"n": {"oneOf": [{"$ref": "#"}, {"allOf": [{"$ref": "#"}]}]}}, "required": ["n"]},
     "$ref '#'"),
    ({"type": "object", "properties": {"l": {"type": "array", "minItems": 1, "items": {"$ref": "#"}}},
      "required": ["l"]}, "$ref '#'"),
    ({"type": "object", "properties": {"l": {"type": "array", "minItems": 2, "prefixItems": [{"type": "integer"}],
                                             "items": {"$ref": "#"}}}, "required": ["l"]}, "$ref '#'"),
    ({"type": "object", "required": ["x"], "additionalProperties": False}, "no JSON value"),
    ({"type": "object", "properties": {"a": False}, "required": ["a"]}, "no JSON value"),
])
def test_schemas_that_match_nothing_are_named(schema: dict, words: str) -> None:
    problem = unmatchable_schema(schema)
    assert problem is not None and words in problem, problem


def test_a_schema_with_too_many_refs_is_refused_without_walking_it_all() -> None:
    schema = {"type": "object", "properties": {f"p{i}": {"$ref": "#/$defs/leaf"} for i in range(MAX_REFS + 1)},
              "required": [f"p{i}" for i in range(MAX_REFS + 1)], "$defs": {"leaf": {"type": "integer"}}}
    assert "more than" in unmatchable_schema(schema)
