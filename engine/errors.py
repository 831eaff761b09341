"""Errors a caller can act on. All are ValueErrors: they describe bad or unservable input."""
from __future__ import annotations


class QueueFullError(ValueError):
    """Too many requests wait already (backpressure: retry later)."""


class PromptTooLongError(ValueError):
    """The prompt does not fit the model's context (or the KV cache)."""
