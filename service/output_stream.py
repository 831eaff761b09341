"""An admitted request's output stream, which ends the request when closed even if never read."""
from __future__ import annotations

from collections.abc import AsyncGenerator, Callable

from engine import RequestOutput


class OutputStream:
    """The outputs of one admitted request, as an async iterator. aclose() ends the request
    whether or not it was read: closing an async generator that never started runs none of its
    code, so a request admitted and then dropped unread (a batch whose next prompt was refused, a
    client gone before its response began) kept running with its id in use."""

    def __init__(self, outputs: AsyncGenerator[RequestOutput, None], end_unread: Callable[[], None]) -> None:
        self._outputs = outputs
        self._end_unread = end_unread
        self._is_started = False
        self._is_closed = False

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> RequestOutput:
        self._is_started = True
        return await self._outputs.__anext__()

    async def aclose(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        if not self._is_started:
            self._end_unread()
        await self._outputs.aclose()
