"""What every tool-call parser shares: the deltas it yields, the stream base (content held
back while it may still turn into a call), and the registry by name.

A parser is fed the model's text a piece at a time and yields deltas: content, and per call its
id and name first, then fragments of its arguments (raw JSON text, as the model wrote it). The
whole answer is the same parser fed the whole text at once, so a stream's deltas always
reassemble into the non-streamed answer (tested by cutting examples at every character).
Whitespace right before a call and right after one is not content.
"""
from __future__ import annotations

import json
import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from service.chat.tool_parsers.json_scan import CallObjectScanner


@dataclass(slots=True)
class ToolCallDelta:
    index: int  # the call's position among this answer's calls
    id: str | None = None  # on the call's first delta, with its name
    name: str | None = None
    arguments: str = ""  # the next fragment of the arguments' JSON text


@dataclass(slots=True)
class ParsedDelta:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)

    def extend(self, other: ParsedDelta) -> None:
        self.content += other.content
        for call in other.calls:
            last = self.calls[-1] if self.calls else None
            if last is not None and last.index == call.index and call.id is None:
                last.arguments += call.arguments
            else:
                self.calls.append(ToolCallDelta(call.index, call.id, call.name, call.arguments))


class _RepeatedCall(Exception):
    """A whole-calls stream met a call it already made: the parse ends there."""


@dataclass(frozen=True, slots=True)
class CutCall:
    """A call that ended before its JSON did: its index (None when cut before its name) and its
    text from the whitespace before it (the format's opening marker included where it has one)."""

    index: int | None
    text: str


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def alphanumeric_call_id(length: int = 9) -> str:
    """An id of `length` letters and digits (Mistral's templates refuse any other tool_call_id)."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(length))


class ParsedAnswer:
    """Deltas folded into the answer: content and the calls (what a non-streamed reply shows)."""

    def __init__(self) -> None:
        self.content = ""
        self.calls: list[ToolCall] = []

    def add(self, delta: ParsedDelta) -> None:
        self.content += delta.content
        for call in delta.calls:
            if call.id is not None:
                self.calls.append(ToolCall(call.id, call.name or "", ""))
            self.calls[call.index].arguments += call.arguments


class ToolCallStream:
    """One answer's parse. Subclasses scan self.text from self.pos; they emit content through
    _content and calls through _call_progress. cut_calls: each call that ended before its JSON did
    (a stop string, a stop token, an abort or max_tokens cut it, so its arguments may not parse),
    with its text (named or not), for a reader that returns only whole calls (service/chat/output.py)."""

    new_id: ClassVar[Callable[[], str]] = staticmethod(new_call_id)

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0
        self.is_final = False
        self._pieces: list[ParsedDelta] = []  # this feed's deltas, in order (content, then calls, each)
        self._held_space = ""  # whitespace at the end of the content so far: a call may follow
        self._skip_space = False  # just after a call: whitespace there is not content
        self._num_calls = 0
        self._call: CallObjectScanner | None = None
        self._call_start = 0  # where the current call's text began (it is content if it fails)
        self._call_sent = 0  # characters of its arguments sent
        self._call_index: int | None = None
        self.cut_calls: list[CutCall] = []
        # A reader that returns whole calls only (service/chat/output.py) sets whole_calls: a cut
        # call's text is then also sent as content (in its place among the content), and a call
        # identical to one already made (same name and arguments) ends the parse there.
        self.whole_calls = False
        self.repeated_index: int | None = None  # the repeated call that ended the parse
        self._made: set[tuple[str, str]] = set()
        self._has_content = False

    @property
    def open_call_index(self) -> int | None:
        """The index of the call being written (its JSON not closed yet); None between calls."""
        return self._call_index if self._call is not None else None

    def _cut(self, end: int) -> None:
        """The current call ended before its JSON did: its text is kept (cut_calls) and, for a
        whole-calls reader, is content, with the whitespace before it when content came first."""
        start = self._call_start
        while self._has_content and start > 0 and self.text[start - 1] in " \t\r\n":
            start -= 1
        self.cut_calls.append(CutCall(self._call_index, self.text[start:end]))
        if self.whole_calls:
            self._content(self.text[start:end])

    def _is_repeat(self, call: CallObjectScanner) -> bool:
        """Whether a finished call repeats one this answer already made (same name, same
        arguments, whatever their layout); remembers it otherwise."""
        try:
            arguments = json.dumps(json.loads(call.arguments), sort_keys=True)
        except ValueError:
            arguments = call.arguments
        key = (call.name or "", arguments)
        if key in self._made:
            return True
        self._made.add(key)
        return False

    def feed(self, text: str, is_final: bool = False) -> ParsedDelta:
        out = ParsedDelta()
        for piece in self.feed_in_order(text, is_final):
            out.extend(piece)
        return out

    def feed_in_order(self, text: str, is_final: bool = False) -> list[ParsedDelta]:
        """feed's delta as pieces in the answer's order: each piece's content comes before its
        calls, so content after a call starts a new piece (the Responses API's items follow it)."""
        self.text += text
        self.is_final = self.is_final or is_final
        if self.repeated_index is None:  # after a repeated call nothing more is read
            try:
                self._scan()
            except _RepeatedCall:  # from deep inside a format's scan: it ends the answer
                self._call = None
        pieces, self._pieces = self._pieces, []
        return pieces

    def _content_piece(self) -> ParsedDelta:
        if not self._pieces or self._pieces[-1].calls:
            self._pieces.append(ParsedDelta())
        return self._pieces[-1]

    def _call_piece(self) -> ParsedDelta:
        if not self._pieces:
            self._pieces.append(ParsedDelta())
        return self._pieces[-1]

    def _scan(self) -> None:
        raise NotImplementedError

    # ---- content ------------------------------------------------------------------------

    def _content(self, text: str, before_call: bool = False) -> None:
        if self._skip_space:
            stripped = text.lstrip()
            if not stripped:
                return
            text, self._skip_space = stripped, False
        text = self._held_space + text
        self._has_content = self._has_content or bool(text.strip())
        if before_call:
            self._add_content(text.rstrip())
            self._held_space = ""
            return
        body = text.rstrip()
        self._add_content(body)
        self._held_space = text[len(body):]
        if self.is_final:
            self._add_content(self._held_space)
            self._held_space = ""

    def _add_content(self, text: str) -> None:
        if text:
            self._content_piece().content += text

    def _content_until(self, marker: str) -> int | None:
        """Content from self.pos up to marker: its index when found, else None, having sent all
        but a tail that may be the marker's beginning (all of it once the text is final)."""
        found = self.text.find(marker, self.pos)
        if found >= 0:
            self._content(self.text[self.pos:found], before_call=True)
            self.pos = found
            return found
        end = len(self.text)
        if not self.is_final:
            for keep in range(min(len(marker) - 1, end - self.pos), 0, -1):
                if marker.startswith(self.text[end - keep:]):
                    end -= keep
                    break
        self._content(self.text[self.pos:end])
        self.pos = end
        return None

    # ---- calls --------------------------------------------------------------------------

    def _start_call(self, start: int) -> None:
        self._call, self._call_start, self._call_sent, self._call_index = CallObjectScanner(), start, 0, None

    def _feed_call(self) -> str:
        """Feed the current call; returns "more" (needs text), "done" or "failed" (its text,
        from where it began, went out as content)."""
        call = self._call
        self.pos = call.feed(self.text, self.pos)
        if self.is_final and not call.is_done:
            call.finish()
            if not call.is_done and not call.is_error:  # cut off (max_tokens, a stop)
                self._call_progress()  # what came is kept, as it was streamed; before its name, nothing
                self._cut(len(self.text))
                self._call = None
                self.pos = len(self.text)
                return "done"
        if call.is_error or (call.is_done and call.name is None) or (self.is_final and not call.is_done):
            if self._call_index is not None:  # already streamed: ends where it broke
                self._cut(self.pos)
                self._call = None
                return "done"
            self._call = None
            self._content(self.text[self._call_start:self.pos])
            return "failed"
        self._call_progress()
        if call.is_done:
            if self.whole_calls and self._is_repeat(call):
                self.repeated_index = self._call_index
                raise _RepeatedCall
            self._call = None
            return "done"
        return "more"

    def _call_progress(self) -> None:
        call = self._call
        if call.name is None:
            return
        if self._call_index is None:
            self._call_index = self._num_calls
            self._num_calls += 1
            self._call_piece().calls.append(ToolCallDelta(self._call_index, self.new_id(), call.name))
        if call.has_arguments:
            arguments = call.arguments
            if len(arguments) > self._call_sent:
                self._call_piece().extend(ParsedDelta(calls=[ToolCallDelta(self._call_index,
                                                                  arguments=arguments[self._call_sent:])]))
                self._call_sent = len(arguments)

    def _after_call(self) -> None:
        self._skip_space = True


class ToolParser:
    """A tool-call format: how calls are written (parsed by new_stream) and the grammar that
    makes the model write them right (service/chat/tool_grammar.py builds it from these parts)."""

    name: ClassVar[str]
    trigger: ClassVar[str]  # the text that opens a call (or a block of calls)

    def new_stream(self) -> ToolCallStream:
        raise NotImplementedError

    arguments_key: ClassVar[str] = "arguments"

    def after_trigger(self, lit: Callable[[str], str], trigger: str, parallel: bool) -> str:
        """The Lark expression for what follows the trigger: the call(s), each a `fn` (the rule
        of one call object). lit: literal text as Lark items; trigger: the trigger's items, for
        formats that repeat it before every call."""
        raise NotImplementedError

    def call_object(self, lit: Callable[[str], str], name: str, arguments: str) -> str:
        """One call object as Lark items: its JSON up to the arguments (name first), the
        arguments' Lark item, the closing brace."""
        head = "{" + json.dumps("name") + ": " + json.dumps(name) + ", " + json.dumps(self.arguments_key) + ": "
        return f'{lit(head)} {arguments} "}}"'

    def call_json(self, name: str, arguments: Any) -> str:
        """One call object's JSON text, as call_object lays it out (arguments: parsed JSON)."""
        return json.dumps({"name": name, self.arguments_key: arguments}, ensure_ascii=False)

    def render_calls(self, calls: list[tuple[str, Any]]) -> str:
        """(name, parsed arguments) calls written in this format (history the template cannot render)."""
        raise NotImplementedError
