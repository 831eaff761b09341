"""One chat answer read as it comes: thinking split off (reasoning parser), tool calls parsed
out of the rest (tool-call parser), and what is left is content. Streamed deltas and the whole
message come from the same fold, so they always agree.

A call is reported (and the finish reason is tool_calls) only when it parsed whole. Where a stop
string or stop token may cut one (holds_calls), the calls are held back until the answer ends:
whole, they go out as calls; cut, the answer's text from the first call on goes out as content."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine import RequestOutput
from service.chat.reasoning_parser import ReasoningParser, ReasoningTokenCount
from service.chat.tool_parsers import ParsedAnswer, ParsedDelta, ToolParser


@dataclass(slots=True)
class ChoiceDelta:
    reasoning: str
    parsed: ParsedDelta

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.parsed)


class ChoiceOutput:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, holds_calls: bool = False,
                 reasoning_marker_ids: tuple[int, int] | None = None) -> None:
        self._reasoning = reasoning.new_stream() if reasoning is not None else None
        # Reasoning tokens: exactly those inside the block when its markers are tokens; else an
        # estimate from the text (the tokens of each output that carried thinking).
        self._token_count = ReasoningTokenCount(reasoning, *reasoning_marker_ids) \
            if reasoning is not None and reasoning_marker_ids is not None else None
        self._tools = tools.new_stream() if tools is not None else None
        self._holds_calls = holds_calls
        self._held: ParsedDelta | None = None  # from the first call on, while held
        self._content_before_held = ""
        self._text = ""  # the answer after the thinking, as the tool parser read it
        self.answer = ParsedAnswer()
        self.reasoning = ""
        self.num_reasoning_tokens = 0
        self.is_parsed = reasoning is not None or tools is not None

    def feed(self, out: RequestOutput) -> ChoiceDelta:
        if self._token_count is not None:
            self._token_count.feed(out.new_token_ids)
            self.num_reasoning_tokens = self._token_count.num_tokens
        return self.feed_text(out.new_text, len(out.new_token_ids), out.is_finished, out.finish_reason)

    def feed_text(self, text: str, num_tokens: int = 0, is_final: bool = False,
                  engine_reason: str | None = None) -> ChoiceDelta:
        reasoning, content = "", text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.feed(text, is_final)
            self.reasoning += reasoning
            if self._token_count is None and (reasoning or self._reasoning.state == "reasoning"):
                self.num_reasoning_tokens += num_tokens
        if self._tools is None:
            parsed = ParsedDelta(content)
        else:
            self._text += content
            parsed = self._tools.feed(content, is_final)
            if self._holds_calls:
                parsed = self._hold(parsed, is_final, engine_reason)
        self.answer.add(parsed)
        return ChoiceDelta(reasoning, parsed)

    def _hold(self, parsed: ParsedDelta, is_final: bool, engine_reason: str | None) -> ParsedDelta:
        """What to send now: all of it before the first call; from there on nothing until the
        end, then the calls if none was cut (or max_tokens cut the last: reported as cut off,
        as without holding), else the rest of the text as content."""
        if self._held is None:
            if not parsed.calls:
                return parsed
            self._held, self._content_before_held = ParsedDelta(), self.answer.content
        self._held.extend(parsed)
        if not is_final:
            return ParsedDelta()
        held, self._held = self._held, None
        if not self._tools.num_cut_calls or engine_reason == "length":
            return held
        before = self._content_before_held
        return ParsedDelta(self._text[len(before):] if self._text.startswith(before) else self._text)

    @property
    def has_calls(self) -> bool:
        return bool(self.answer.calls)

    @property
    def has_cut_call(self) -> bool:
        return self._tools is not None and self._tools.num_cut_calls > 0

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """tool_calls for an answer that ended on its own with calls, all of them whole."""
        if engine_reason == "stop" and self.has_calls and not self.has_cut_call:
            return "tool_calls"
        return engine_reason

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
