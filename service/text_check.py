"""Text a request carries must be encodable as UTF-8 before anything tokenizes or renders it.

JSON can spell a lone surrogate ("\\ud800"), which Python decodes into a str that no UTF-8
encoder accepts: the tokenizer (inside apply_chat_template) and the JSON renderers would fail
on it with a server error. Each door walks its request once and refuses such a string with the
field that holds it (the engine's own check, before tokenizing, is the last line).
"""
from __future__ import annotations

import json
from typing import Any

from engine import is_encodable

# Lists of these are skipped whole (a prompt of token ids), decided by a C-level pass over types.
_SCALARS = frozenset({int, float, bool, type(None)})


def _fields(model: Any) -> list[tuple[str, Any]]:
    """A pydantic model's set fields by the names the request used (aliases included)."""
    out = []
    for name, info in type(model).model_fields.items():
        if name in model.model_fields_set:
            out.append((info.alias or name, getattr(model, name)))
    return out


def unencodable_path(value: Any, path: str = "") -> str | None:
    """The path ("messages[0].content", "input") of the first string in value (dicts, lists,
    pydantic models, dict keys included) that cannot be encoded as UTF-8; None if there is none.
    Iterative: a deeply nested body cannot exhaust the stack."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if not is_encodable(item):
                return where
        elif isinstance(item, dict):
            children = []
            for key, child in item.items():
                if isinstance(key, str) and not is_encodable(key):
                    return where
                children.append((child, f"{where}.{key}" if where else str(key)))
            stack.extend(reversed(children))
        elif isinstance(item, list | tuple):
            if not set(map(type, item)) <= _SCALARS:
                stack.extend(reversed([(child, f"{where}[{i}]") for i, child in enumerate(item)]))
        elif hasattr(type(item), "model_fields"):
            stack.extend(reversed([(child, f"{where}.{name}" if where else name) for name, child in _fields(item)]))
    return None


def json_text_unencodable(text: str) -> bool:
    """Whether JSON text (a call's arguments) decodes to a string with no UTF-8 form: its escapes
    can spell a lone surrogate that the text itself does not hold."""
    if "\\u" not in text:
        return False
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # not JSON: it goes on as the text it is
        return False
    return unencodable_path(value) is not None
