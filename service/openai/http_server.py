"""uvicorn serving an ASGI app (the OpenAI-compatible API) on the gRPC server's event loop."""
from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn


class _EmbeddedServer(uvicorn.Server):
    """uvicorn sharing the gRPC server's loop: signals stay with InferenceServer, which drains both."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    def __init__(self, app: Any, host: str, port: int) -> None:
        self.config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                     lifespan="off", timeout_graceful_shutdown=5)
        self.server = _EmbeddedServer(self.config)
        self._task: asyncio.Task | None = None
        # Bound here, not by uvicorn (which exits the process when a port is taken): an OSError
        # reaches the caller, and port 0 gives a free port that `port` then reads back.
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((host, port))
        except OSError:
            self.socket.close()
            raise
        self.socket.set_inheritable(True)
        self.port = self.socket.getsockname()[1]

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self.server.serve(sockets=[self.socket]))
        while not self.server.started:
            if self._task.done():
                self._task.result()
                raise OSError(f"HTTP server on {self.config.host}:{self.port} did not start")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._task is None:
            return
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
