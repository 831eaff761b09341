"""Whether any finite JSON value can match a JSON schema, as far as its references go.

llguidance compiles a schema whose `$ref` cycle has no way out (every path through it needs the
cycle again: `{"properties": {"next": {"$ref": "#"}}, "required": ["next"]}`) into a grammar no
finite document completes, so constrained output would run to max_tokens and never parse; such a
schema is refused, named, when it is compiled (and the tool grammars' schemas at admission).

Productivity is a least fixed point: a `$ref` target is productive once some finite instance of
it exists given the targets already known productive. Each target's schema is first reduced to
an and/or formula over the targets it needs (the required properties, an array's minimum items,
allOf / anyOf / oneOf), then the formulas are iterated until nothing changes.
"""
from __future__ import annotations

from typing import Any

# A schema's $ref nodes are bounded so the fixed point stays cheap (tool schemas are checked on
# the event loop); real schemas hold a handful.
MAX_REFS = 1000
# Deeper than this the walk stops and assumes a value exists (the grammar compiler refuses
# schemas nested that deep on its own).
_MAX_DEPTH = 128

Formula = bool | str | tuple[str, tuple["Formula", ...]]  # a constant, a $ref target, ("and" | "or", parts)


class _TooManyRefs(Exception):
    pass


def _resolve(root: dict[str, Any], ref: str) -> Any:
    """The schema a local $ref ("#", "#/$defs/x") points to; None when it is not local or not found
    (the grammar compiler reports those)."""
    if not ref.startswith("#"):
        return None
    node: Any = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _and(parts: list[Formula]) -> Formula:
    if any(p is False for p in parts):
        return False
    rest = tuple(p for p in parts if p is not True)
    return True if not rest else rest[0] if len(rest) == 1 else ("and", rest)


def _or(parts: list[Formula]) -> Formula:
    if any(p is True for p in parts):
        return True
    rest = tuple(p for p in parts if p is not False)
    return False if not rest else rest[0] if len(rest) == 1 else ("or", rest)


class _Reducer:
    """Reduces schemas to formulas over the local $ref targets they need, collecting the targets."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.targets: dict[str, Formula] = {}
        self.num_refs = 0
        self._pending: list[str] = []

    def reduce(self, schema: Any, depth: int = 0) -> Formula:
        if schema is False:
            return False
        if not isinstance(schema, dict) or depth > _MAX_DEPTH:
            return True
        parts: list[Formula] = []
        ref = schema.get("$ref")
        if isinstance(ref, str) and _resolve(self.root, ref) is not None:
            self.num_refs += 1
            if self.num_refs > MAX_REFS:
                raise _TooManyRefs
            if ref not in self.targets:
                self.targets[ref] = True  # placeholder until reduced
                self._pending.append(ref)
            parts.append(ref)
        for key in ("allOf", "anyOf", "oneOf"):
            subs = schema.get(key)
            if isinstance(subs, list) and subs:
                reduced = [self.reduce(s, depth + 1) for s in subs]
                parts.append(_and(reduced) if key == "allOf" else _or(reduced))
        kinds = schema.get("type")
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if isinstance(kinds, list) and kinds and all(k in ("object", "array") for k in kinds):
            # Only containers that must hold something can be unproductive; any scalar type ends the walk.
            options = []
            if "object" in kinds:
                options.append(self._object(schema, depth))
            if "array" in kinds:
                options.append(self._array(schema, depth))
            parts.append(_or(options))
        return _and(parts)

    def _object(self, schema: dict[str, Any], depth: int) -> Formula:
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = schema.get("required") if isinstance(schema.get("required"), list) else []
        extra = schema.get("additionalProperties", True)
        return _and([self.reduce(properties[name] if name in properties else extra, depth + 1)
                     for name in required if isinstance(name, str)])

    def _array(self, schema: dict[str, Any], depth: int) -> Formula:
        min_items = schema.get("minItems", 0)
        if not isinstance(min_items, int) or min_items <= 0:
            return True
        prefix = schema.get("prefixItems") if isinstance(schema.get("prefixItems"), list) else []
        needed = [self.reduce(s, depth + 1) for s in prefix[:min_items]]
        if min_items > len(prefix):
            needed.append(self.reduce(schema.get("items", True), depth + 1))
        return _and(needed)

    def reduce_targets(self) -> None:
        while self._pending:
            ref = self._pending.pop()
            self.targets[ref] = self.reduce(_resolve(self.root, ref))


def _holds(formula: Formula, known: set[str]) -> bool:
    if isinstance(formula, bool):
        return formula
    if isinstance(formula, str):
        return formula in known
    op, parts = formula
    return all(_holds(p, known) for p in parts) if op == "and" else any(_holds(p, known) for p in parts)


def _first_ref(formula: Formula, known: set[str]) -> str | None:
    """A target the formula needs that is not productive (for the message)."""
    if isinstance(formula, str):
        return None if formula in known else formula
    if isinstance(formula, tuple):
        for part in formula[1]:
            found = _first_ref(part, known)
            if found is not None:
                return found
    return None


def unmatchable_schema(schema: Any) -> str | None:
    """What makes a JSON schema match no finite value (None: some value matches it, as far as
    this walk sees: references, required properties, minimum items, combinators)."""
    if not isinstance(schema, dict):
        return None if schema is not False else "no JSON value matches it"
    try:
        stuck = _unproductive_ref(schema)
    except _TooManyRefs:
        return f"more than {MAX_REFS} $ref"
    if stuck == "":
        return "no JSON value matches it"
    if stuck is not None:
        return (f"no finite JSON value matches it: every way through $ref {stuck!r} needs it again (a recursive "
                "schema needs a way out, such as an optional property, an alternative or an empty array)")
    return None


def _unproductive_ref(schema: dict[str, Any]) -> str | None:
    """The $ref target that makes the schema match nothing ("" when no reference is to blame), or None
    when some finite value matches it (as far as this walk sees)."""
    reducer = _Reducer(schema)
    top = reducer.reduce(schema)
    reducer.reduce_targets()
    known: set[str] = set()
    changed = True
    while changed:  # at most one pass per target: each pass makes at least one more productive
        changed = False
        for ref, formula in reducer.targets.items():
            if ref not in known and _holds(formula, known):
                known.add(ref)
                changed = True
    if _holds(top, known):
        return None
    return _first_ref(top, known) or ""
