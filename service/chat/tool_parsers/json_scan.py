"""Incremental JSON scanning for tool calls: where a value ends, and a call object's name and
arguments, fed a piece of text at a time (a stream cut anywhere gives the same result)."""
from __future__ import annotations

import json
import re

_WS = " \t\r\n"
_SCALAR_CHARS = frozenset("+-.0123456789eEtrufalsn")
_STRING_RUN = re.compile(r'[^"\\]+')
_CONTAINER_RUN = re.compile(r'[^"{}\[\]]+')


class JsonValueScanner:
    """One JSON value's raw text, fed piece by piece; `is_done` once it has ended (a scalar ends
    at the first character that cannot continue it, which is not consumed). Leading whitespace
    is skipped; the structure is checked only as far as finding the end needs (json.loads the
    text for more)."""

    def __init__(self) -> None:
        self.chunks: list[str] = []
        self.kind = ""  # "string" | "container" | "scalar" once the first character came
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.is_done = False
        self.is_error = False

    @property
    def text(self) -> str:
        return "".join(self.chunks)

    def feed(self, text: str, i: int) -> int:
        """Consume text[i:] until the value ends or the text does; returns the next index."""
        n = len(text)
        while i < n and not self.is_done and not self.is_error:
            if not self.kind:
                i = self._start(text, i)
            elif self.in_string:
                i = self._string(text, i)
            elif self.kind == "scalar":
                start = i
                while i < n and text[i] in _SCALAR_CHARS:
                    i += 1
                self.chunks.append(text[start:i])
                self.is_done = i < n
            else:
                match = _CONTAINER_RUN.match(text, i)
                if match:
                    self.chunks.append(match.group())
                    i = match.end()
                    continue
                c = text[i]
                self.chunks.append(c)
                i += 1
                if c == '"':
                    self.in_string = True
                elif c in "{[":
                    self.depth += 1
                else:
                    self.depth -= 1
                    self.is_done = self.depth == 0
        return i

    def finish(self) -> None:
        """The text has ended: a scalar ends with it."""
        if self.kind == "scalar" and self.chunks:
            self.is_done = True

    def _start(self, text: str, i: int) -> int:
        c = text[i]
        if c in _WS:
            return i + 1
        if c == '"':
            self.kind, self.in_string = "string", True
        elif c in "{[":
            self.kind, self.depth = "container", 1
        elif c in _SCALAR_CHARS:
            self.kind = "scalar"
            return i
        else:
            self.is_error = True
            return i
        self.chunks.append(c)
        return i + 1

    def _string(self, text: str, i: int) -> int:
        if self.escaped:
            self.escaped = False
            self.chunks.append(text[i])
            return i + 1
        match = _STRING_RUN.match(text, i)
        if match:
            self.chunks.append(match.group())
            return match.end()
        c = text[i]
        self.chunks.append(c)
        if c == "\\":
            self.escaped = True
        else:  # the closing quote
            self.in_string = False
            self.is_done = self.kind == "string"
        return i + 1


class CallObjectScanner:
    """A tool call's JSON object ({"name": ..., "arguments": {...}}, other keys skipped), fed piece
    by piece: `name` once its string has closed, `arguments` the raw text of the arguments value
    so far (a JSON string holding JSON is decoded when it ends), `is_done` after the closing
    brace, `is_error` when the text is not such an object."""

    def __init__(self, name_keys: tuple[str, ...] = ("name",),
                 arguments_keys: tuple[str, ...] = ("arguments", "parameters")) -> None:
        self.name_keys, self.arguments_keys = name_keys, arguments_keys
        self.state = "start"  # start, key, colon, value, after, done
        self.name: str | None = None
        self._key = ""
        self._value: JsonValueScanner | None = None
        self._arguments: JsonValueScanner | None = None
        self.is_error = False

    @property
    def is_done(self) -> bool:
        return self.state == "done"

    @property
    def arguments(self) -> str:
        """The arguments' text so far (a JSON-string value: nothing until it has ended)."""
        value = self._arguments
        if value is None:
            return ""
        if value.kind != "string":
            return value.text
        if not value.is_done:
            return ""
        try:
            decoded = json.loads(value.text)
        except ValueError:
            return value.text
        return decoded if isinstance(decoded, str) else value.text

    @property
    def has_arguments(self) -> bool:
        return self._arguments is not None and (self._arguments.kind != "string" or self._arguments.is_done)

    def feed(self, text: str, i: int) -> int:
        n = len(text)
        while i < n and not self.is_done and not self.is_error:
            if self.state in ("value", "key") and self._value is not None:
                i = self._value.feed(text, i)
                self._after_value()
                continue
            c = text[i]
            if c in _WS:
                i += 1
            elif self.state == "start":
                self._expect(c == "{", "key")
                i += 1
            elif self.state == "key":
                if c == "}" and self._key == "":
                    self.state = "done"
                else:
                    self._expect(c == '"', "key")
                    self._value = JsonValueScanner()
                    self._value.feed('"', 0)
                i += 1
            elif self.state == "colon":
                self._expect(c == ":", "value")
                self._value = JsonValueScanner()
                if self._key in self.arguments_keys:
                    self._arguments = self._value
                i += 1
            elif self.state == "after":
                if c == ",":
                    self.state, self._key = "key", "\0"  # a key must follow a comma
                elif c == "}":
                    self.state = "done"
                else:
                    self.is_error = True
                i += 1
        return i

    def finish(self) -> None:
        if self._value is not None:
            self._value.finish()
            self._after_value()

    def _expect(self, ok: bool, state: str) -> None:
        if ok:
            self.state = state
        else:
            self.is_error = True

    def _after_value(self) -> None:
        value = self._value
        if value.is_error:
            self.is_error = True
        if not value.is_done:
            return
        self._value = None
        if self.state == "key":
            try:
                self._key = json.loads(value.text)
            except ValueError:
                self.is_error = True
            self.state = "colon"
            return
        if self._key in self.name_keys and self.name is None:
            try:
                name = json.loads(value.text)
            except ValueError:
                name = None
            if not isinstance(name, str):
                self.is_error = True
            self.name = name
        self.state = "after"
