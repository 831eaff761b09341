"""A tool's parameters must describe an object some finite JSON value matches."""
from __future__ import annotations

import pytest

from service.chat.tool_schema import parameters_problem


@pytest.mark.parametrize(("schema", "words"), [
    ({"type": "string"}, 'type "object"'),
    ({"type": ["object", "null"]}, 'type "object"'),
    ([], "JSON schema object"),
    ({"type": "object", "properties": {"me": {"$ref": "#"}}, "required": ["me"]}, "$ref '#'"),
])
def test_parameters_that_are_no_object_or_match_nothing_are_named(schema: object, words: str) -> None:
    problem = parameters_problem(schema)
    assert problem is not None and words in problem, problem


@pytest.mark.parametrize("schema", [{}, {"type": "object"}, {"type": ["object"]}, {"properties": {"a": {}}},
                                    {"type": "object", "properties": {"me": {"$ref": "#"}}}])
def test_object_schemas_pass(schema: dict) -> None:
    assert parameters_problem(schema) is None
