"""A tool's parameters must describe an object some finite JSON value matches."""
from __future__ import annotations

import pytest

from service.chat.tool_schema import MAX_REFS, parameters_problem

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
])
def test_schemas_with_a_finite_value_pass(schema: dict) -> None:
    assert parameters_problem(schema) is None


@pytest.mark.parametrize(("schema", "words"), [
    ({"type": "string"}, 'type "object"'),
    ({"type": ["object", "null"]}, 'type "object"'),
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
def test_schemas_that_match_nothing_or_no_object_are_named(schema: dict, words: str) -> None:
    problem = parameters_problem(schema)
    assert problem is not None and words in problem, problem


def test_a_schema_with_too_many_refs_is_refused_without_walking_it_all() -> None:
    schema = {"type": "object", "properties": {f"p{i}": {"$ref": "#/$defs/leaf"} for i in range(MAX_REFS + 1)},
              "required": [f"p{i}" for i in range(MAX_REFS + 1)], "$defs": {"leaf": {"type": "integer"}}}
    assert "more than" in parameters_problem(schema)
