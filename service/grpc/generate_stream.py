"""One Generate call's life, shared by both gRPC doors (minivllm.v1 and vLLM's engine contract):
the ids, the parameters, admission (a refusal is a status, named the same by either door), the
engine's outputs turned into the door's messages, and the call's end (the engine stream closed,
the observer told its status). A door says only how its request reads and its outputs are sent."""
from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import grpc

from engine import RequestOutput, SamplingParams
from service.async_engine import AsyncEngine
from service.grpc.status import admission_status, failed_output_status
from service.observability.request_observer import CallInfo, RequestObserver

M = TypeVar("M")  # a door's response message


@dataclass(frozen=True, slots=True)
class GenerateIds:
    request_id: str  # the client's, or made up when it gave none
    engine_id: str  # unique for the server's life: routes the request's outputs

    @classmethod
    def of(cls, engine: AsyncEngine, request_id: str) -> GenerateIds:
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        return cls(request_id, engine.new_engine_id(request_id[:64]))


@dataclass(frozen=True, slots=True)
class Admitted(Generic[M]):
    """An admitted request: its engine outputs, and the door's messages for one output."""

    outputs: AsyncGenerator[RequestOutput, None]
    respond: Callable[[RequestOutput], AsyncIterator[M]]
    on_end: Callable[[], None] | None = None  # the door's own bookkeeping, once the call ends


def call_info(protocol: str, operation: str, context: grpc.aio.ServicerContext, method: str = "Generate") -> CallInfo:
    """The observer's view of a call (its metadata carries the trace context)."""
    carrier = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
    return CallInfo(protocol, method, operation, carrier)


async def generate_stream(context: grpc.aio.ServicerContext, engine: AsyncEngine, observer: RequestObserver,
                          call: CallInfo, ids: GenerateIds, read_params: Callable[[], SamplingParams],
                          admit: Callable[[SamplingParams], Awaitable[Admitted[M]]]) -> AsyncIterator[M]:
    """The call's messages. read_params: the request's SamplingParams (a ValueError is answered
    as a refusal, after the observer has seen the call); admit: the request into the engine."""
    params, params_error = None, None
    try:
        params = read_params()
    except ValueError as exc:
        params_error = exc
    handle = observer.start(ids.request_id, ids.engine_id, call, params)
    status, message, final, admitted = grpc.StatusCode.OK, "", None, None
    try:
        try:
            if params_error is not None:
                raise params_error
            admitted = await admit(params)
        except Exception as exc:
            refused = admission_status(exc)
            if refused is None:
                raise
            status, message = refused, str(exc)
            await context.abort(status, message)
        async for out in admitted.outputs:
            if out.finish_reason == "error":
                final = out
                status = failed_output_status(engine)
                message = out.error or "engine error"
                await context.abort(status, message)
            if out.is_finished:
                final = out
            async for response in admitted.respond(out):
                yield response
    except BaseException as exc:
        if status is grpc.StatusCode.OK:
            status, message = grpc.StatusCode.CANCELLED, type(exc).__name__
        raise
    finally:
        if admitted is not None:
            if admitted.on_end is not None:
                admitted.on_end()
            # Close the engine stream now (it aborts an unfinished request and frees its KV
            # blocks), not whenever the garbage collector gets to it.
            await admitted.outputs.aclose()
        observer.finish(handle, final, None if status is grpc.StatusCode.OK else status.name, message,
                        {"rpc.grpc.status_code": status.value[0]})
