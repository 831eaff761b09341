"""The engine thread ("the heartbeat") and its asyncio front door.

One thread owns the LLMEngine. Commands (add, abort) reach it through a queue it blocks on
when idle, so an idle server burns no CPU; each step's outputs go back to the asyncio loop
in one call_soon_threadsafe, where they fan out to per-request queues. Step stats go to
listeners on the engine thread (metrics, tracing), never the other way round.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from engine import LLMEngine, RequestOutput, SamplingParams, StepStats

logger = logging.getLogger(__name__)

StatsListener = Callable[[StepStats], None]


@dataclass(slots=True)
class _Add:
    prompt: str | list[int] | None
    messages: list[dict[str, str]] | None
    params: SamplingParams
    request_id: str
    priority: int
    admitted: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Call:
    fn: Callable[[LLMEngine], Any]
    result: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


_STOP = object()


class EngineDeadError(RuntimeError):
    """The engine thread is gone; no request can be served."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, stats_listeners: list[StatsListener] | None = None) -> None:
        self.engine = engine
        self.stats_listeners = list(stats_listeners or [])
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._idle = threading.Event()
        self._idle.set()

    # ---- asyncio side --------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    @property
    def num_active_streams(self) -> int:
        return len(self._streams)

    async def generate(self, request_id: str, params: SamplingParams, prompt: str | list[int] | None = None,
                       messages: list[dict[str, str]] | None = None, priority: int = 0
                       ) -> AsyncIterator[RequestOutput]:
        """Admit a request, then return its output stream.

        Admission errors (ValueError and subclasses) raise here, before any output, so the
        caller can answer with the right status code.
        """
        if not self._thread.is_alive():
            raise EngineDeadError("the engine thread is not running")
        stream: asyncio.Queue[RequestOutput] = asyncio.Queue()
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        self._streams[request_id] = stream
        cmd = _Add(prompt, messages, params, request_id, priority)
        self._inbox.put(cmd)
        try:
            await asyncio.wrap_future(cmd.admitted)
        except BaseException:
            self._streams.pop(request_id, None)
            self.abort(request_id)  # cancelled while admitting: make sure it ends (no-op otherwise)
            raise
        return self._iterate(request_id, stream)

    async def _iterate(self, request_id: str, stream: asyncio.Queue[RequestOutput]) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                out = await stream.get()
                while not out.is_finished and not stream.empty():
                    out = out.merged_with(stream.get_nowait())  # one message for a backlog
                finished = out.is_finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)  # client went away: free its KV blocks now

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread (the tokenizer is not safe to share across threads)."""
        cmd = _Call(fn)
        self._inbox.put(cmd)
        return await asyncio.wrap_future(cmd.result)

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no request is in the engine (for a graceful drain)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self._idle.wait, timeout)

    def stop(self, timeout: float = 10.0) -> None:
        self._inbox.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    # ---- engine thread -------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                busy = engine.has_unfinished_requests()
                if not busy:
                    self._idle.set()
                    cmd = self._inbox.get()  # block: nothing to do until a command comes
                    if not self._handle(cmd):
                        return
                while True:  # drain whatever else arrived, without blocking
                    try:
                        cmd = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    if not self._handle(cmd):
                        return
                if not engine.has_unfinished_requests():
                    continue
                self._idle.clear()
                try:
                    outputs, stats = engine.step()
                except Exception as exc:  # noqa: BLE001 - keep serving; fail what was in flight
                    logger.exception("engine step failed")
                    outputs, stats = engine.fail_all(f"engine error: {exc}"), None
                if outputs:
                    self._loop.call_soon_threadsafe(self._dispatch, outputs)
                if stats is not None:
                    for listener in self.stats_listeners:
                        try:
                            listener(stats)
                        except Exception:  # noqa: BLE001 - observability must not stop serving
                            logger.exception("stats listener failed")
        finally:
            outputs = self.engine.fail_all("engine stopped")
            if outputs and self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._dispatch, outputs)
            self._idle.set()

    def _handle(self, cmd: Any) -> bool:
        if cmd is _STOP:
            return False
        if isinstance(cmd, _Abort):
            self.engine.abort_request(cmd.request_id)
            return True
        if isinstance(cmd, _Call):
            if cmd.result.set_running_or_notify_cancel():
                try:
                    cmd.result.set_result(cmd.fn(self.engine))
                except Exception as exc:  # noqa: BLE001 - handed back to the caller
                    cmd.result.set_exception(exc)
            return True
        if not cmd.admitted.set_running_or_notify_cancel():
            return True  # the caller gave up before admission
        try:
            prompt = cmd.prompt if cmd.messages is None else self.engine.apply_chat_template(cmd.messages)
            self.engine.add_request(prompt, cmd.params, request_id=cmd.request_id, priority=cmd.priority)
        except Exception as exc:  # noqa: BLE001 - handed back to the caller as is
            cmd.admitted.set_exception(exc)
        else:
            cmd.admitted.set_result(None)
        return True
