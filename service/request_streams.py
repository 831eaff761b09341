"""Each admitted request's output stream, on the asyncio side: the engine thread's outputs fan
out here by engine id, and a request's client id stays taken while its stream lives."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable

from engine import RequestIdInUseError, RequestOutput


class RequestStreams:
    def __init__(self, abort: Callable[[str], None]) -> None:
        """abort(engine_id): ends a request in the engine (a stream closed before its end)."""
        self._abort = abort
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}  # by engine id
        self._client_ids: set[str] = set()  # ids of live requests, as their clients named them

    def __len__(self) -> int:
        return len(self._queues)

    def claim(self, request_id: str) -> None:
        """Take a client's id for a new request: two live requests may not share one."""
        if request_id in self._client_ids:
            raise RequestIdInUseError("request_id", f"{request_id!r} belongs to a request still running")
        self._client_ids.add(request_id)

    def release(self, request_id: str) -> None:
        self._client_ids.discard(request_id)

    def open(self, engine_id: str) -> asyncio.Queue[RequestOutput]:
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[engine_id] = queue
        return queue

    def discard(self, engine_id: str) -> None:
        self._queues.pop(engine_id, None)

    def dispatch(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs to their streams (a stream already closed drops its request's)."""
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    async def iterate(self, engine_id: str, request_id: str, queue: asyncio.Queue[RequestOutput],
                      num_samples: int = 1) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs until every sample has finished."""
        finished = False
        num_finished = 0
        try:
            # generate() takes this first item: closing a generator that never started runs none
            # of its code, so a request admitted and dropped unread (a batch whose next prompt was
            # refused, a client gone before its response began) kept running with its id in use.
            yield None  # type: ignore[misc]
            while not finished:
                out = await queue.get()
                # One message for a backlog (samples of an n > 1 request interleave: not merged).
                while num_samples == 1 and not out.is_finished and not queue.empty():
                    out = out.merged_with(queue.get_nowait())
                num_finished += out.is_finished
                finished = num_finished >= num_samples or out.finish_reason == "error"
                yield out
        finally:
            self.discard(engine_id)
            self.release(request_id)
            if not finished:
                self._abort(engine_id)  # client went away: free its KV blocks now
