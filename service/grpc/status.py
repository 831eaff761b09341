"""The gRPC status of a call the engine refused or failed (or that finds no engine to serve it),
shared by both contracts (minivllm.v1 and vLLM's engine service), so a refusal reads the same
whichever door it came by."""
from __future__ import annotations

import grpc

from engine import LimitExceededError, QueueFullError, RequestIdInUseError
from service.async_engine import AsyncEngine, EngineDeadError
from service.serving_state import EngineUnavailableError, ServingState, TaskNotServedError

_ADMISSION_STATUS: tuple[tuple[type[Exception] | tuple[type[Exception], ...], grpc.StatusCode], ...] = (
    (TaskNotServedError, grpc.StatusCode.UNIMPLEMENTED),  # the RPC is not enabled for this model
    ((QueueFullError, LimitExceededError), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (RequestIdInUseError, grpc.StatusCode.ALREADY_EXISTS),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (EngineDeadError, grpc.StatusCode.UNAVAILABLE),
)


def admission_status(exc: Exception) -> grpc.StatusCode | None:
    """The status for a request not admitted (a full queue, an id in use, bad input, a dead
    engine); None for anything else, which the caller re-raises."""
    return next((status for kinds, status in _ADMISSION_STATUS if isinstance(exc, kinds)), None)


def failed_output_status(engine: AsyncEngine) -> grpc.StatusCode:
    """The status for an output that ended in an engine error: a dead engine is the server's
    state (retry elsewhere); a failed step is a fault."""
    return grpc.StatusCode.UNAVAILABLE if engine.is_dead else grpc.StatusCode.INTERNAL


async def serving_engine(state: ServingState, context: grpc.aio.ServicerContext,
                         for_new_request: bool = False, task: str | None = None) -> AsyncEngine:
    """The engine (ready for a new request of `task`, or just loaded for a question about it), or
    the call ends UNAVAILABLE (loading, draining or dead) or UNIMPLEMENTED (served for another task)."""
    try:
        return state.ready_engine(task) if for_new_request else state.loaded_engine()
    except EngineUnavailableError as exc:
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
    except TaskNotServedError as exc:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, str(exc))
