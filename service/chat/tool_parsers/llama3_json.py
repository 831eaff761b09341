"""Llama 3.1 / 3.2 JSON format: the answer is the call(s) itself, {"name": ...,
"parameters": {...}} objects separated by "; ", optionally after <|python_tag|>; an answer
that does not begin with one of those is content."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from service.chat.tool_parsers.base import ToolCallStream, ToolParser

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonStream(ToolCallStream):
    def __init__(self) -> None:
        super().__init__()
        self.state = "start"

    def _scan(self) -> None:
        while True:
            if self.state == "start":
                rest = self.text[self.pos:]
                if rest.startswith(PYTHON_TAG):
                    self.pos += len(PYTHON_TAG)
                    rest = rest[len(PYTHON_TAG):]
                    if not rest and not self.is_final:
                        return
                elif not self.is_final and (not rest or PYTHON_TAG.startswith(rest)):
                    return
                if rest.startswith("{"):
                    self._start_call(self.pos)
                    self.state = "call"
                else:
                    self.state = "text"
            if self.state == "text":
                self._content(self.text[self.pos:])
                self.pos = len(self.text)
                return
            if self.state == "call":
                result = self._feed_call()
                if result == "more":
                    return
                self.state = "text" if result == "failed" else "between"
                if result == "failed":
                    continue
            if self.state == "between":
                while self.pos < len(self.text) and self.text[self.pos] in " \t\r\n":
                    self.pos += 1
                if self.pos == len(self.text) and not self.is_final:
                    return
                if self.text.startswith(";", self.pos):
                    self.pos += 1
                    self._start_call(self.pos)
                    self.state = "call"
                    continue
                self._after_call()
                self.state = "text"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    trigger = ""  # the answer's first character
    arguments_key = "parameters"

    def new_stream(self) -> ToolCallStream:
        return Llama3JsonStream()

    def after_trigger(self, lit: Callable[[str], str], trigger: str, parallel: bool) -> str:
        return 'fn ("; " fn)*' if parallel else "fn"

    def render_calls(self, calls: list[tuple[str, Any]]) -> str:
        return "; ".join(self.call_json(name, arguments) for name, arguments in calls)
