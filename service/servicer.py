"""The Inference service: validates requests, feeds the engine thread, streams deltas."""
from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from engine import LimitExceededError, QueueFullError, RequestIdInUseError, SamplingParams
from service.async_engine import AsyncEngine, EngineDeadError
from service.pb import inference_pb2 as pb
from service.pb import inference_pb2_grpc as pb_grpc
from service.protocol import messages_from_proto, model_info_to_proto, response_from_output, sampling_params_from_proto

logger = logging.getLogger(__name__)


class RequestObserver:
    """Hooks the servicer calls per request (tracing plugs in here); no-ops by default."""

    def start(self, request_id: str, engine_id: str, request: pb.GenerateRequest, params: SamplingParams | None,
              context: grpc.aio.ServicerContext) -> Any:
        """request_id: the client's; engine_id: the engine's (StepStats name requests by it);
        params: the request's validated sampling parameters, None when they were invalid."""
        return None

    def finish(self, handle: Any, final: Any, status: grpc.StatusCode, message: str = "") -> None:
        return None


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(self, observer: RequestObserver | None = None) -> None:
        self.engine: AsyncEngine | None = None  # set once the model has loaded
        self.is_draining = False
        self.observer = observer or RequestObserver()

    def _ready_engine(self) -> AsyncEngine | None:
        return None if self.is_draining else self.engine

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        engine = self._ready_engine()
        if engine is None:
            reason = "model is still loading" if self.engine is None else \
                "the engine died" if self.engine.is_dead else "server is draining"
            await context.abort(grpc.StatusCode.UNAVAILABLE, reason)
        request_id = request.request_id or f"req-{uuid.uuid4().hex}"
        engine_id = engine.new_engine_id(request_id[:64])
        params, params_error = None, None
        try:
            params = sampling_params_from_proto(request.sampling)
        except ValueError as exc:
            params_error = exc
        handle = self.observer.start(request_id, engine_id, request, params, context)
        status, message, final, stream = grpc.StatusCode.OK, "", None, None
        try:
            try:
                if params_error is not None:
                    raise params_error
                prompt, messages = self._input(request)
                stream = await engine.generate(request_id, params, prompt=prompt, messages=messages,
                                               priority=request.priority, engine_id=engine_id)
            except (QueueFullError, LimitExceededError) as exc:
                status, message = grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
                await context.abort(status, message)
            except RequestIdInUseError as exc:
                status, message = grpc.StatusCode.ALREADY_EXISTS, str(exc)
                await context.abort(status, message)
            except ValueError as exc:
                status, message = grpc.StatusCode.INVALID_ARGUMENT, str(exc)
                await context.abort(status, message)
            except EngineDeadError as exc:
                status, message = grpc.StatusCode.UNAVAILABLE, str(exc)
                await context.abort(status, message)
            async for out in stream:
                if out.finish_reason == "error":
                    final = out
                    # A dead engine is the server's state (retry elsewhere); a failed step is a fault.
                    status = grpc.StatusCode.UNAVAILABLE if engine.is_dead else grpc.StatusCode.INTERNAL
                    message = out.error or "engine error"
                    await context.abort(status, message)
                if out.is_finished:
                    final = out
                if out.new_token_ids or out.is_finished:
                    yield response_from_output(out, request_id)
        except BaseException as exc:
            if status is grpc.StatusCode.OK:
                status = grpc.StatusCode.CANCELLED
                message = type(exc).__name__
            raise
        finally:
            if stream is not None:
                # Close the engine stream now (it aborts an unfinished request and frees its KV
                # blocks), not whenever the garbage collector gets to it.
                await stream.aclose()
            self.observer.finish(handle, final, status, message)

    @staticmethod
    def _input(request: pb.GenerateRequest) -> tuple[str | list[int] | None, list[dict[str, str]] | None]:
        kind = request.WhichOneof("input")
        if kind == "prompt":
            if not request.prompt:
                raise ValueError("prompt: must not be empty")
            return request.prompt, None
        if kind == "prompt_token_ids":
            if not request.prompt_token_ids.ids:
                raise ValueError("prompt_token_ids: must not be empty")
            return list(request.prompt_token_ids.ids), None
        if kind == "messages":
            return None, messages_from_proto(request.messages)
        raise ValueError("input: one of prompt, prompt_token_ids or messages is required")

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "model is still loading")
        return model_info_to_proto(self.engine.engine.model_info())

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "model is still loading")
        try:
            kind = request.WhichOneof("input")
            if kind == "prompt":
                if not request.prompt:
                    raise ValueError("prompt: must not be empty")
                ids = await self.engine.tokenize(prompt=request.prompt)
            elif kind == "messages":
                ids = await self.engine.tokenize(messages=messages_from_proto(request.messages))
            else:
                raise ValueError("input: one of prompt or messages is required")
        except LimitExceededError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.TokenizeResponse(token_ids=ids, count=len(ids),
                                   max_model_len=self.engine.engine.model_info().max_model_len)
