"""Hermes / Qwen2.5 / Qwen3 format: each call a JSON object between <tool_call> and
</tool_call> on lines of their own, text allowed around them. Also minivllm's generic format
for templates that know no tools (docs/openai_tools.md)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from service.chat.tool_parsers.base import ToolCallStream, ToolParser

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesStream(ToolCallStream):
    def __init__(self) -> None:
        super().__init__()
        self.state = "content"

    def _scan(self) -> None:
        while True:
            if self.state == "content":
                found = self._content_until(OPEN)
                if found is None:
                    return
                self.pos += len(OPEN)
                self._start_call(found)
                self.state = "call"
            if self.state == "call":
                result = self._feed_call()
                if result == "more":
                    return
                self.state = "close" if result == "done" else "content"
            if self.state == "close":
                i = self.pos
                while i < len(self.text) and self.text[i] in " \t\r\n":
                    i += 1
                seen = self.text[i:i + len(CLOSE)]
                if seen != CLOSE and CLOSE.startswith(seen) and not self.is_final:
                    return  # the closing tag may still be on its way
                if seen == CLOSE:
                    self.pos = i + len(CLOSE)
                self._after_call()
                self.state = "content"


class HermesToolParser(ToolParser):
    name = "hermes"
    trigger = OPEN

    def new_stream(self) -> ToolCallStream:
        return HermesStream()

    def after_trigger(self, lit: Callable[[str], str], trigger: str, parallel: bool) -> str:
        one = f'{lit(chr(10))} fn {lit(chr(10) + CLOSE)}'
        return f'{one} ({lit(chr(10))} {trigger} {one})*' if parallel else one

    def render_calls(self, calls: list[tuple[str, Any]]) -> str:
        return "\n".join(f"{OPEN}\n{self.call_json(name, arguments)}\n{CLOSE}" for name, arguments in calls)
