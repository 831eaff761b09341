"""Admission checks of a function tool's `parameters` (a JSON schema), shared by every door.

A call's arguments are a JSON object, so the schema must describe one: a function whose
parameters are `{"type": "string"}` would get `"Paris"` as its arguments, which no client can
apply. And a schema no finite JSON value matches (a `$ref` cycle with no way out) would compile
into a tool grammar that matches nothing, so the call would come back with empty arguments; both
are refused here, named, before any grammar is built (the tool grammar embeds the schema in Lark
text, which the engine's compiler does not look into).
"""
from __future__ import annotations

from typing import Any

from engine import unmatchable_schema


def parameters_problem(schema: Any) -> str | None:
    """What is wrong with a tool's parameters schema (None: nothing this check sees)."""
    if not isinstance(schema, dict):
        return "must be a JSON schema object"
    kind = schema.get("type")
    if kind is not None and kind != "object" and kind != ["object"]:
        return f'must describe a JSON object (type "object"): the arguments of a call are one, got type {kind!r}'
    return unmatchable_schema(schema)
