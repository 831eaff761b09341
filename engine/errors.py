"""Errors a caller can act on. All are ValueErrors: they describe bad or unservable input."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Self


def renamed_path(path: str, names: Mapping[str, str]) -> str:
    """path with its longest leading part that names maps renamed, whole components only
    ("structured_output.json_schema" by {"structured_output": "text.format"} is
    "text.format.json_schema"; "stop_token_ids" is not renamed by "stop")."""
    for old in sorted(names, key=len, reverse=True):
        if path == old or path.startswith((old + ".", old + "[")):
            return names[old] + path[len(old):]
    return path


class FieldError(ValueError):
    """A request field's value is refused. field: the field's path as the engine names it
    ("max_tokens", "structured_output.json_schema", "messages[0].content"); message: what is
    wrong with it. A front door that calls the fields otherwise renames the paths by a table of
    its own (`renamed`), never by reading the text.

    A message that names other fields holds them as {0}, {1}... with their paths in mentions,
    so a rename reaches them too; sep joins field and message (": ", or " " where the message
    reads on from the name: "max_tokens must be >= 1")."""

    def __init__(self, field: str, message: str, *, mentions: tuple[str, ...] = (), sep: str = ": ") -> None:
        self.field, self.message, self.mentions, self.sep = field, message, mentions, sep
        super().__init__(self._text())

    def _text(self) -> str:
        # Only a message with mentions is a template: others may quote the client's braces.
        detail = self.message.format(*self.mentions) if self.mentions else self.message
        return f"{self.field}{self.sep}{detail}"

    def __str__(self) -> str:
        return self._text()

    def renamed(self, names: Mapping[str, str]) -> Self:
        """This error with its field paths renamed by names; the same class, so the status a door
        maps it to is kept."""
        copy = type(self).__new__(type(self))
        copy.__dict__.update(self.__dict__)
        copy.field = renamed_path(self.field, names)
        copy.mentions = tuple(renamed_path(m, names) for m in self.mentions)
        copy.args = (copy._text(),)
        return copy


class LimitExceededError(FieldError):
    """The request is too big for a configured limit (prompt, stop strings, id, max_tokens...)."""


class QueueFullError(ValueError):
    """Too many requests wait already (backpressure: retry later)."""


class PromptTooLongError(LimitExceededError):
    """The prompt does not fit the model's context (or the KV cache)."""


class RequestIdInUseError(FieldError):
    """A live request already has this id (it may be reused once that request has ended)."""
