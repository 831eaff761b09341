"""One chat answer read as it comes: thinking split off (reasoning parser), tool calls parsed
out of the rest (tool-call parser), and what is left is content. Streamed deltas and the whole
message come from the same fold, so they always agree."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine import RequestOutput
from service.reasoning_parser import ReasoningParser
from service.tool_parsers import ParsedAnswer, ParsedDelta, ToolParser


@dataclass(slots=True)
class ChoiceDelta:
    reasoning: str
    parsed: ParsedDelta

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.parsed)


class ChoiceOutput:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self._reasoning = reasoning.new_stream() if reasoning is not None else None
        self._tools = tools.new_stream() if tools is not None else None
        self.answer = ParsedAnswer()
        self.reasoning = ""
        self.num_reasoning_tokens = 0
        self.is_parsed = reasoning is not None or tools is not None

    def feed(self, out: RequestOutput) -> ChoiceDelta:
        return self.feed_text(out.new_text, len(out.new_token_ids), out.is_finished)

    def feed_text(self, text: str, num_tokens: int = 0, is_final: bool = False) -> ChoiceDelta:
        reasoning, content = "", text
        if self._reasoning is not None:
            # Counted by output: the one that ends the block counts whole (one token, unless a
            # slow reader's outputs were merged).
            if self._reasoning.is_reasoning:
                self.num_reasoning_tokens += num_tokens
            reasoning, content = self._reasoning.feed(text, is_final)
            self.reasoning += reasoning
        parsed = self._tools.feed(content, is_final) if self._tools is not None else ParsedDelta(content)
        self.answer.add(parsed)
        return ChoiceDelta(reasoning, parsed)

    @property
    def has_calls(self) -> bool:
        return bool(self.answer.calls)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return "tool_calls" if engine_reason == "stop" and self.has_calls else engine_reason

    def message(self) -> dict[str, Any]:
        """The chat message (content None beside calls when there is none, as OpenAI sends it)."""
        message: dict[str, Any] = {"role": "assistant",
                                   "content": self.answer.content if self.answer.content or not self.has_calls else None}
        if self._reasoning is not None:
            message["reasoning_content"] = self.reasoning or None
        if self.has_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in self.answer.calls]
        return message

    def delta(self, parsed: ChoiceDelta) -> dict[str, Any]:
        """The chat.completion.chunk delta of one step."""
        delta: dict[str, Any] = {}
        if parsed.reasoning:
            delta["reasoning_content"] = parsed.reasoning
        if parsed.parsed.content:
            delta["content"] = parsed.parsed.content
        if parsed.parsed.calls:
            delta["tool_calls"] = [_call_delta(c) for c in parsed.parsed.calls]
        return delta


def _call_delta(call: Any) -> dict[str, Any]:
    if call.id is not None:
        return {"index": call.index, "id": call.id, "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}
    return {"index": call.index, "function": {"arguments": call.arguments}}
