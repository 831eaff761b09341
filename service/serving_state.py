"""Whether the server can take a request now: one state both front doors (gRPC and HTTP) read."""
from __future__ import annotations

import asyncio

from service.async_engine import AsyncEngine


class EngineUnavailableError(RuntimeError):
    """No new request can be taken now (loading, draining or a dead engine); retry elsewhere or later."""


class TaskNotServedError(ValueError):
    """The model is served for another task than the request's (`--task`): a generation request
    to an embedding server, or an embedding request to a generation server."""

    def __init__(self, served: str, asked: str) -> None:
        super().__init__(f"model: this server's model is served for {served!r}, not {asked!r} requests "
                         f"(serve it with --task {asked})")


class ServingState:
    def __init__(self) -> None:
        self.engine: AsyncEngine | None = None  # set once the model has loaded
        self.is_draining = False
        self.loaded = asyncio.Event()  # set with engine
        # The engine's start-up phase while it loads (engine/execution/startup_phases.py's names).
        self.loading_phase = "starting"

    def set_loading_phase(self, phase: str) -> None:
        """The engine's on_phase: called on the engine thread. A plain assignment, read by the
        loop's thread as it is (one reference swapped under the GIL): a phase shown a moment late
        is fine, a hop through the loop would only add latency."""
        self.loading_phase = phase

    @property
    def loading_message(self) -> str:
        return f"model is still loading ({self.loading_phase})"

    def set_engine(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.loaded.set()

    def ready_engine(self, task: str | None = None) -> AsyncEngine:
        """The engine, if it takes new requests (of `task`: generate or embed, every door's route
        or RPC for one); EngineUnavailableError saying why not, TaskNotServedError for another task."""
        if self.engine is None:
            raise EngineUnavailableError(self.loading_message)
        if self.engine.is_dead:
            raise EngineUnavailableError("the engine died")
        if self.is_draining:
            raise EngineUnavailableError("server is draining")
        served = self.engine.model_info().task
        if task is not None and served != task:
            raise TaskNotServedError(served, task)
        return self.engine

    def loaded_engine(self) -> AsyncEngine:
        """The engine for read-only calls (model info, tokenize), also while draining."""
        if self.engine is None:
            raise EngineUnavailableError(self.loading_message)
        return self.engine
