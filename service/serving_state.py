"""Whether the server can take a request now: one state both front doors (gRPC and HTTP) read."""
from __future__ import annotations

import asyncio

from service.async_engine import AsyncEngine


class EngineUnavailableError(RuntimeError):
    """No new request can be taken now (loading, draining or a dead engine); retry elsewhere or later."""


class ServingState:
    def __init__(self) -> None:
        self.engine: AsyncEngine | None = None  # set once the model has loaded
        self.is_draining = False
        self.loaded = asyncio.Event()  # set with engine

    def set_engine(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.loaded.set()

    def ready_engine(self) -> AsyncEngine:
        """The engine, if it takes new requests; EngineUnavailableError saying why not."""
        if self.engine is None:
            raise EngineUnavailableError("model is still loading")
        if self.engine.is_dead:
            raise EngineUnavailableError("the engine died")
        if self.is_draining:
            raise EngineUnavailableError("server is draining")
        return self.engine

    def loaded_engine(self) -> AsyncEngine:
        """The engine for read-only calls (model info, tokenize), also while draining."""
        if self.engine is None:
            raise EngineUnavailableError("model is still loading")
        return self.engine
