"""Runs an InferenceServer on 127.0.0.1 in a background thread with its own event loop."""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from engine import EngineConfig, LLMEngine
from service.async_engine import StatsListener
from service.server import InferenceServer, ServerConfig
from service.servicer import RequestObserver


class ServerThread:
    def __init__(self, engine_config: EngineConfig, stats_listeners: list[StatsListener] | None = None,
                 observer: RequestObserver | None = None, interceptors: list | None = None,
                 engine_factory: Callable[[], LLMEngine] | None = None, wait_ready: bool = True,
                 **server_options: object) -> None:
        self.config = ServerConfig(host="127.0.0.1", port=0, drain_grace_s=10.0, engine=engine_config,
                                   **server_options)
        self._factory = engine_factory
        self._listeners, self._observer, self._interceptors = stats_listeners, observer, interceptors
        self._ready = threading.Event()
        self._started = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.server: InferenceServer | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()
        if not self._started.wait(60):
            raise RuntimeError("server did not start")
        if wait_ready and not self._ready.wait(120):
            raise RuntimeError("server did not load its model")

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        try:
            self.server = InferenceServer(self.config, self._listeners, self._observer, self._interceptors)
        finally:
            self._started.set()
        await self.server.start(self._factory)
        self._ready.set()
        await self.server.wait_stopped()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    @property
    def engine(self) -> LLMEngine:
        return self.server.async_engine.engine

    def wait_until(self, predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.02)
        return predicate()

    def stop(self) -> None:
        if self.loop is not None and self.server is not None:
            asyncio.run_coroutine_threadsafe(self.server.drain_and_stop(), self.loop).result(30)
        self._thread.join(30)
