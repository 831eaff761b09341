"""Mistral format: [TOOL_CALLS] (a special token in Mistral's tokenizers) and then a JSON list of
call objects: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from service.chat.tool_parsers.base import ToolCallStream, ToolParser, alphanumeric_call_id

TRIGGER = "[TOOL_CALLS]"


class MistralStream(ToolCallStream):
    new_id = staticmethod(alphanumeric_call_id)  # Mistral's format: a call id is 9 letters and digits

    def __init__(self) -> None:
        super().__init__()
        self.state = "content"
        self._block_start = 0

    def _next_char(self) -> str | None:
        """The next character past whitespace (self.pos moves to it), None when none came yet."""
        while self.pos < len(self.text) and self.text[self.pos] in " \t\r\n":
            self.pos += 1
        return self.text[self.pos] if self.pos < len(self.text) else None

    def _scan(self) -> None:
        while True:
            if self.state == "content":
                found = self._content_until(TRIGGER)
                if found is None:
                    return
                self.pos += len(TRIGGER)
                self._block_start = found
                self.state = "open"
            if self.state == "open":
                c = self._next_char()
                if c is None and not self.is_final:
                    return
                if c == "[":
                    self.pos += 1
                    self.state = "list"
                elif c == "{":
                    self.state = "single"
                else:  # not a list of calls after all
                    self._content(self.text[self._block_start:self.pos])
                    self.state = "content"
                    continue
                self._start_call(self.pos)
            if self.state in ("list", "single"):
                result = self._feed_call()
                if result == "more":
                    return
                if result == "failed":
                    self.state = "content"
                    continue
                if self.state == "single":
                    self._after_call()
                    self.state = "content"
                    continue
                self.state = "between"
            if self.state == "between":
                c = self._next_char()
                if c is None and not self.is_final:
                    return
                if c == ",":
                    self.pos += 1
                    self._start_call(self.pos)
                    self.state = "list"
                    continue
                if c == "]":
                    self.pos += 1
                self._after_call()
                self.state = "content"


class MistralToolParser(ToolParser):
    name = "mistral"
    trigger = TRIGGER

    def new_stream(self) -> ToolCallStream:
        return MistralStream()

    def after_trigger(self, lit: Callable[[str], str], trigger: str, parallel: bool) -> str:
        return '"[" fn (", " fn)* "]"' if parallel else '"[" fn "]"'

    def render_calls(self, calls: list[tuple[str, Any]]) -> str:
        return TRIGGER + "[" + ", ".join(self.call_json(name, arguments) for name, arguments in calls) + "]"
