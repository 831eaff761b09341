"""Errors a caller can act on. All are ValueErrors: they describe bad or unservable input."""
from __future__ import annotations


class LimitExceededError(ValueError):
    """The request is too big for a configured limit (prompt, stop strings, id, max_tokens...)."""


class QueueFullError(ValueError):
    """Too many requests wait already (backpressure: retry later)."""


class PromptTooLongError(LimitExceededError):
    """The prompt does not fit the model's context (or the KV cache)."""


class RequestIdInUseError(ValueError):
    """A live request already has this id (it may be reused once that request has ended)."""
