"""The grammar that makes tool calls parse: Lark (llguidance's dialect) built from the tools'
JSON schemas in the format's layout.

required / a named function: the answer is the call(s). auto: free text, and once the format's
trigger appears (a lazy lexeme ends the text there; a special-token trigger cannot occur in
text at all) the call grammar takes over, so a call the model starts always completes as valid
JSON matching its function's schema. With a JSON answer format beside tools, the answer is that
JSON or the calls. Compiled (and cached) by the engine's grammar compiler off the engine thread.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from service.chat.tool_parsers import ToolParser

# Whitespace inside arguments is free but bounded: a sampled model cannot spend its budget on it.
ARGUMENTS_JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,4}"}


@dataclass(frozen=True, slots=True)
class FunctionSpec:
    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None  # a JSON schema (None: any object)
    strict: bool | None = None

    def to_openai(self) -> dict[str, Any]:
        """The function as OpenAI's tools list (and HF chat templates) write it."""
        function: dict[str, Any] = {"name": self.name, "description": self.description,
                                    "parameters": self.parameters or {"type": "object", "properties": {}}}
        return {"type": "function", "function": function}


def _schema(function: FunctionSpec) -> str:
    schema = dict(function.parameters or {"type": "object"})
    schema.setdefault("x-guidance", ARGUMENTS_JSON_OPTIONS)
    return json.dumps(schema)


class LarkText:
    """Literal text as Lark items: the tokenizer's added tokens in it (a format's markers, such as
    Qwen's <tool_call>) by id, since llguidance never matches them as text, the rest quoted."""

    def __init__(self, added_tokens: dict[str, int] | None = None) -> None:
        self.added = dict(added_tokens or {})
        names = sorted(self.added, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(re.escape(n) for n in names) + ")") if names else None

    def __call__(self, text: str) -> str:
        parts = self._split.split(text) if self._split is not None else [text]
        return " ".join(f"<[{self.added[p]}]>" if p in self.added else json.dumps(p) for p in parts if p)

    def is_token(self, text: str) -> bool:
        return text in self.added


def tool_call_grammar(parser: ToolParser, functions: list[FunctionSpec], *, required: bool, parallel: bool,
                      lit: LarkText | None = None, answer_schema: dict[str, Any] | None = None) -> str:
    """Lark text for the calls of `functions` in parser's format. required: the answer is one or
    more calls; else (auto) text, or with answer_schema that JSON, unless a call starts.
    lit: writes literal text (the tokenizer's added tokens by id; a trigger that is one cannot
    occur in free text at all)."""
    if not functions:
        raise ValueError("tools: at least one function is needed")
    lit = lit or LarkText()
    trigger = lit(parser.trigger) if parser.trigger else ""
    after = parser.after_trigger(lit, trigger, parallel)
    calls = f"{trigger} {after}".strip()
    lines = ["%llguidance {}"]
    if required:
        lines.append(f"start: {calls}")
    elif answer_schema is not None:
        answer = dict(answer_schema)
        answer.setdefault("x-guidance", ARGUMENTS_JSON_OPTIONS)
        lines += [f"start: answer | {calls}", f"answer: %json {json.dumps(answer)}"]
    elif not parser.trigger:  # the answer's first character decides (Llama 3 JSON)
        lines += [f"start: PLAIN_TEXT | {calls}", r"PLAIN_TEXT: /([^{](.|\n)*)?/"]
    elif lit.is_token(parser.trigger):
        lines += [f"start: TEXT | TEXT {calls}", r"TEXT: /(.|\n)*/"]
    else:
        lines += [f"start: TEXT | text_then_trigger {after}", f"text_then_trigger[lazy]: TEXT {trigger}",
                  r"TEXT: /(.|\n)*/"]
    lines.append("fn: " + " | ".join(f"fn_{i}" for i in range(len(functions))))
    for i, function in enumerate(functions):
        lines.append(f"fn_{i}: {parser.call_object(lit, function.name, '%json ' + _schema(function))}")
    return "\n".join(lines) + "\n"
