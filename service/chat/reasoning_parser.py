"""Reasoning parsers: a thinking block (<think> ... </think>) moved out of the answer, by name
(the server's reasoning_parser option).

deepseek_r1: the answer starts in thinking (its template may already have opened <think> in the
prompt): everything up to the first </think> is reasoning, an optional leading <think> dropped;
an answer that never closes it is all reasoning. qwen3: only an answer that opens with <think>
thinks; any other is all content. Fed a piece at a time like the tool-call parsers, so a stream
reassembles into the whole answer; whitespace between the block and the answer is neither's.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

START, END = "<think>", "</think>"


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    name: str
    starts_in_reasoning: bool  # an answer without <think> still begins in thinking
    start: str = START
    end: str = END

    def new_stream(self) -> ReasoningStream:
        return ReasoningStream(self)


REASONING_PARSERS: Mapping[str, ReasoningParser] = MappingProxyType({
    "deepseek_r1": ReasoningParser("deepseek_r1", starts_in_reasoning=True),
    "qwen3": ReasoningParser("qwen3", starts_in_reasoning=False),
})


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser: {name!r} is not one of {', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name]


class ReasoningStream:
    """One answer's split: feed() returns (reasoning, content) deltas."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.pos = 0
        self.state = "start"  # start, reasoning, gap (whitespace after the block), content
        self.is_final = False

    @property
    def is_reasoning(self) -> bool:
        """Still thinking (or not yet known): the constrained part has not begun."""
        return self.state in ("start", "reasoning")

    def feed(self, text: str, is_final: bool = False) -> tuple[str, str]:
        self.text += text
        self.is_final = self.is_final or is_final
        reasoning, content = "", ""
        if self.state == "start":
            self._start()
        if self.state == "reasoning":
            reasoning = self._reasoning()
        if self.state == "gap":
            while self.pos < len(self.text) and self.text[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.text):
                self.state = "content"
        if self.state == "content":
            content, self.pos = self.text[self.pos:], len(self.text)
        return reasoning, content

    def _start(self) -> None:
        start = self.parser.start
        rest = self.text[self.pos:].lstrip()
        if not self.is_final and len(rest) < len(start) and start.startswith(rest):
            return  # may still become <think>
        if rest.startswith(start):
            self.pos = len(self.text) - len(rest) + len(start)
            self.state = "reasoning"
        else:
            self.state = "reasoning" if self.parser.starts_in_reasoning else "content"

    def _reasoning(self) -> str:
        end = self.parser.end
        found = self.text.find(end, self.pos)
        if found >= 0:
            reasoning = self.text[self.pos:found]
            self.pos = found + len(end)
            self.state = "gap"
            return reasoning
        stop = len(self.text)
        if not self.is_final:
            for keep in range(min(len(end) - 1, stop - self.pos), 0, -1):
                if end.startswith(self.text[stop - keep:]):
                    stop -= keep
                    break
        reasoning, self.pos = self.text[self.pos:stop], stop
        return reasoning


class ReasoningTokenCount:
    """The tokens inside an answer's thinking block, counted by the markers' ids (each one token
    in Qwen3's and DeepSeek-R1's tokenizers); the markers themselves are not reasoning."""

    def __init__(self, parser: ReasoningParser, start_id: int, end_id: int) -> None:
        self.starts_in_reasoning = parser.starts_in_reasoning
        self.start_id, self.end_id = start_id, end_id
        self.state = "start"  # start, inside, after
        self.num_tokens = 0

    def feed(self, token_ids: list[int]) -> None:
        for token_id in token_ids:
            if self.state == "start":
                if token_id == self.start_id:
                    self.state = "inside"
                    continue
                self.state = "inside" if self.starts_in_reasoning else "after"
            if self.state == "inside":
                if token_id == self.end_id:
                    self.state = "after"
                else:
                    self.num_tokens += 1
