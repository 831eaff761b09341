"""What the HTTP door checks on a validated body before the engine sees it, and how it names the
engine's fields back in the request's own terms."""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from engine import FieldError
from service.text_check import json_text_unencodable, unencodable_path

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def check_text(body: Any) -> None:
    """FieldError naming the first string of the body that has no UTF-8 form (a lone surrogate,
    which JSON can spell as "\\ud800"), before anything tokenizes or renders it."""
    path = unencodable_path(body)
    if path is None:  # a call's arguments are JSON text: their escapes are decoded before rendering
        path = next((where for where, text in _json_texts(body) if json_text_unencodable(text)), None)
    if path is not None:
        raise FieldError(path, "is not valid Unicode text: it holds a lone surrogate (such as \\ud800), "
                         "which cannot be encoded as UTF-8")


def _json_texts(body: Any) -> Iterator[tuple[str, str]]:
    """The JSON texts of a body: chat's tool calls' arguments, the Responses API's function_call items'."""
    for i, message in enumerate(getattr(body, "messages", None) or []):
        for j, call in enumerate(getattr(message, "tool_calls", None) or []):
            yield f"messages[{i}].tool_calls[{j}].function.arguments", call.function.arguments
    items = getattr(body, "input", None)
    for i, item in enumerate(items if isinstance(items, list) else []):
        if isinstance(item, dict) and item.get("type") == "function_call" and isinstance(item.get("arguments"), str):
            yield f"input[{i}].arguments", item["arguments"]


def _constraint_field(body: Any) -> tuple[str, str] | None:
    """The request field a structured-output constraint came from, and where its schema sits;
    None when the request has none (only one may be set: _SamplingRequest refuses two)."""
    fmt = getattr(body, "response_format", None)
    if fmt is not None and fmt.type != "text":
        return "response_format", "response_format.json_schema.schema" if fmt.type == "json_schema" \
            else "response_format"
    for key, value in (getattr(body, "structured_outputs", None) or {}).items():
        if value is not None and value is not False:
            return f"structured_outputs.{key}", f"structured_outputs.{key}"
    for key in _GUIDED:
        if getattr(body, key, None) is not None:
            return key, key
    return None


def engine_field_names(body: Any, is_chat: bool) -> Mapping[str, str]:
    """The engine's field paths (FieldError.field) as this request calls them: the constraint by the
    field that set it (`structured_output.json_schema` is `response_format.json_schema.schema`), a
    chat's prompt by its messages, max_tokens by the name the request used."""
    names: dict[str, str] = {}
    source = _constraint_field(body)
    if source is not None:
        field, schema = source
        names.update({"structured_output": field, "structured_output.json_schema": schema,
                      **{f"structured_output.{kind}": field for kind in ("json_object", "regex", "grammar", "choice")}})
    if is_chat:
        names["prompt"] = "messages"
        if getattr(body, "max_completion_tokens", None) is not None:
            names["max_tokens"] = "max_completion_tokens"
    return names
