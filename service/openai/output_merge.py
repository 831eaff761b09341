"""One output stream from several requests' streams: a completions call with a batch of prompts
runs one engine request per prompt, and its choices are numbered across them."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator

from engine import RequestOutput


class MergedOutputs:
    """Outputs of every stream as they come, sample j of stream i renumbered i * num_samples + j.
    aclose() (or an error in one stream) closes them all, read or not, which ends what is unfinished."""

    def __init__(self, streams: list[AsyncGenerator[RequestOutput, None]], num_samples: int) -> None:
        self._streams = streams
        self._num_samples = num_samples
        self._queue: asyncio.Queue[RequestOutput | Exception | None] = asyncio.Queue()
        self._pumps: list[asyncio.Future[None]] = []
        self._num_ended = 0

    def __aiter__(self) -> MergedOutputs:
        return self

    async def _pump(self, i: int, stream: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async for out in stream:
                await self._queue.put(dataclasses.replace(out, index=i * self._num_samples + out.index))
            await self._queue.put(None)  # this stream has ended
        except Exception as exc:  # handed to the reader, which raises it
            await self._queue.put(exc)

    async def __anext__(self) -> RequestOutput:
        if not self._pumps:
            self._pumps = [asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(self._streams)]
        while self._num_ended < len(self._streams):
            item = await self._queue.get()
            if item is None:
                self._num_ended += 1
            elif isinstance(item, Exception):
                raise item
            else:
                return item
        raise StopAsyncIteration

    async def aclose(self) -> None:
        for task in self._pumps:
            task.cancel()
        for task in self._pumps:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for stream in self._streams:
            with contextlib.suppress(Exception):
                await stream.aclose()
