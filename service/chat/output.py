"""One chat answer read as it comes: thinking split off (reasoning parser), tool calls parsed
out of the rest (tool-call parser), and what is left is content. Streamed deltas and the whole
message come from the same fold, so they always agree.

Calls always parse, in every mode (docs/openai_tools.md):
- a call goes out whole, once its JSON has closed (streamed: one delta with its id, name and
  arguments), so a stream never shows a call that later turns out cut;
- a call the answer ended inside (max_tokens, a stop string or token) is no call: its text is
  content, the calls completed before it stay calls, and the finish reason is the engine's
  (length, stop);
- a call identical to one the answer already made (same name and arguments) ends the calls: it
  and all that follows are dropped, the sample's generation is stopped (stop_sample), and the
  answer finishes with tool_calls. A sampled model that loops on one call would otherwise
  repeat it until max_tokens and leave the agent with a cut answer."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine import RequestOutput
from service.chat.reasoning_parser import ReasoningParser, ReasoningTokenCount
from service.chat.tool_parsers import ParsedAnswer, ParsedDelta, ToolCallDelta, ToolParser

StopSample = Callable[[str, int], None]  # (engine request id, sample index): end that sample now


@dataclass(slots=True)
class ChoiceDelta:
    reasoning: str
    parsed: ParsedDelta  # the answer's part of this step: its content and its calls
    # The same in the answer's order (each piece's content before its calls), for a reader whose
    # output follows it (the Responses API's items); empty pieces left out.
    pieces: list[ParsedDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.parsed)


class ChoiceOutput:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None,
                 reasoning_marker_ids: tuple[int, int] | None = None, stop_sample: StopSample | None = None) -> None:
        """stop_sample: how to end the sample's generation once a repeated call has ended its
        answer (None: it runs on, its text dropped)."""
        self._reasoning = reasoning.new_stream() if reasoning is not None else None
        # Reasoning tokens: exactly those inside the block when its markers are tokens; else an
        # estimate from the text (the tokens of each output that carried thinking).
        self._token_count = ReasoningTokenCount(reasoning, *reasoning_marker_ids) \
            if reasoning is not None and reasoning_marker_ids is not None else None
        self._tools = tools.new_stream() if tools is not None else None
        if self._tools is not None:
            self._tools.whole_calls = True
        self._pending: dict[int, ToolCallDelta] = {}  # calls being written, by the parser's index
        self._num_sent = 0  # calls sent (a dropped call leaves no gap in the indices)
        self._stop_sample = stop_sample
        self.answer = ParsedAnswer()
        self.reasoning = ""
        self.num_reasoning_tokens = 0

    @property
    def ended_on_repeat(self) -> bool:
        """A repeated call ended the answer (whatever the engine generated after it is dropped)."""
        return self._tools is not None and self._tools.repeated_index is not None

    def feed(self, out: RequestOutput) -> ChoiceDelta:
        if self.ended_on_repeat:
            return ChoiceDelta("", ParsedDelta())  # tokens generated before the stop took effect: dropped
        if self._token_count is not None:
            self._token_count.feed(out.new_token_ids)
            self.num_reasoning_tokens = self._token_count.num_tokens
        delta = self.feed_text(out.new_text, len(out.new_token_ids), out.is_finished)
        # Asked once: the next feed returns early above.
        if self.ended_on_repeat and not out.is_finished and self._stop_sample is not None:
            self._stop_sample(out.request_id, out.index)
        return delta

    def feed_text(self, text: str, num_tokens: int = 0, is_final: bool = False) -> ChoiceDelta:
        reasoning, content = "", text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.feed(text, is_final)
            self.reasoning += reasoning
            if self._token_count is None and (reasoning or self._reasoning.state == "reasoning"):
                self.num_reasoning_tokens += num_tokens
        if self._tools is None:
            pieces = [ParsedDelta(content)]
        else:
            pieces = self._whole_calls(self._tools.feed_in_order(content, is_final))
        parsed = ParsedDelta()
        for piece in pieces:
            parsed.extend(piece)
        self.answer.add(parsed)
        return ChoiceDelta(reasoning, parsed, [p for p in pieces if p])

    def _whole_calls(self, pieces: list[ParsedDelta]) -> list[ParsedDelta]:
        """The parser's pieces with each call held until its JSON closed, then sent whole where
        its last delta came (first, when none came this time); a cut call (its text came as
        content) and a repeated one are dropped."""
        last_piece: dict[int, int] = {}
        for i, piece in enumerate(pieces):
            for call in piece.calls:
                if call.id is not None:
                    self._pending[call.index] = ToolCallDelta(call.index, call.id, call.name, call.arguments)
                else:
                    self._pending[call.index].arguments += call.arguments
                last_piece[call.index] = i
        stream = self._tools
        dropped = {c.index for c in stream.cut_calls} | {stream.repeated_index}
        out = [ParsedDelta(p.content) for p in pieces]
        front = ParsedDelta()  # calls that closed with no delta of theirs in this feed
        for index in sorted(self._pending):
            if index == stream.open_call_index:
                break  # still being written
            call = self._pending.pop(index)
            if index not in dropped:
                target = out[last_piece[index]] if index in last_piece else front
                target.calls.append(ToolCallDelta(self._num_sent, call.id, call.name, call.arguments))
                self._num_sent += 1
        return [front, *out]

    @property
    def has_calls(self) -> bool:
        return bool(self.answer.calls)

    @property
    def has_cut_call(self) -> bool:
        """The answer ended inside a call (named or not)."""
        return self._tools is not None and bool(self._tools.cut_calls)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """tool_calls for an answer that ended on its own with calls and none cut, or that a
        repeated call ended (however the engine then stopped it); else the engine's reason
        (length with calls: they are whole, the cut one is content)."""
        if engine_reason is None or engine_reason == "error":
            return engine_reason
        if self.ended_on_repeat or (engine_reason == "stop" and self.has_calls and not self.has_cut_call):
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
