"""Field names in errors, per front door: the chat planning and the engine name the fields of a
chat completion (max_tokens, response_format, tools...); gRPC and the Responses API call the
same things by their own names, and an error must name the field the client set."""
from __future__ import annotations

import re
from collections.abc import Mapping

from pydantic import ValidationError

from service.openai.protocol import UnsupportedFieldError, field_path

_HEAD = re.compile(r"[A-Za-z0-9_.\[\]]+")


def _renamed_path(path: str, names: Mapping[str, str]) -> str:
    """path with its longest leading part that names maps (whole components only) renamed."""
    for old in sorted(names, key=len, reverse=True):
        if path == old or path.startswith((old + ".", old + "[")):
            return names[old] + path[len(old):]
    return path


def renamed(exc: ValueError, names: Mapping[str, str], words: Mapping[str, str] | None = None) -> ValueError:
    """exc with the field its message starts with renamed by names (and, by words, field names
    it mentions later); the same class, so the status it maps to is kept. A pydantic
    ValidationError becomes an UnsupportedFieldError naming its first error's field."""
    if isinstance(exc, ValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        path = field_path(first.get("loc", ())) or ""
        return UnsupportedFieldError(_renamed_path(path, names), first.get("msg", "invalid"))
    message = str(exc)
    head = _HEAD.match(message)
    if head is not None:
        message = _renamed_path(head.group(), names) + message[head.end():]
    for old, new in (words or {}).items():
        message = re.sub(rf"\b{re.escape(old)}\b", new, message)
    if isinstance(exc, UnsupportedFieldError):
        param = _renamed_path(exc.param, names)
        return UnsupportedFieldError(param, message.split(": ", 1)[-1])
    try:
        return type(exc)(message)
    except TypeError:  # an exception class with its own constructor: the message as a plain ValueError
        return ValueError(message)
