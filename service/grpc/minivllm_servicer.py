"""The Inference service: validates requests, feeds the engine thread, streams deltas."""
from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from engine import LimitExceededError
from service.async_engine import AsyncEngine
from service.chat.output import ChoiceOutput
from service.chat.tools import ChatTools
from service.field_names import renamed
from service.grpc.minivllm_protocol import (
    add_parsed,
    logprob_token_ids,
    messages_from_proto,
    model_info_to_proto,
    response_from_output,
    sampling_params_from_proto,
    tools_from_proto,
)
from service.grpc.status import admission_status, failed_output_status
from service.observability.request_observer import CallInfo, RequestObserver
from service.pb import inference_pb2 as pb
from service.pb import inference_pb2_grpc as pb_grpc
from service.serving_state import EngineUnavailableError, ServingState

__all__ = ["InferenceServicer", "RequestObserver"]

logger = logging.getLogger(__name__)

# The chat planning names chat-completion fields; on this door they sit in the request's messages
# and sampling.
CHAT_FIELDS = {"tools": "messages.tools", "stop": "sampling.stop",
               "response_format": "sampling.structured_output"}


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(self, state: ServingState, observer: RequestObserver | None = None,
                 chat_tools: ChatTools | None = None) -> None:
        self.state = state
        self.observer = observer or RequestObserver()
        self.chat_tools = chat_tools or ChatTools()

    @property
    def engine(self) -> AsyncEngine | None:
        return self.state.engine

    async def _loaded_engine(self, context: grpc.aio.ServicerContext) -> AsyncEngine:
        try:
            return self.state.loaded_engine()
        except EngineUnavailableError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            engine = self.state.ready_engine()
        except EngineUnavailableError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        request_id = request.request_id or f"req-{uuid.uuid4().hex}"
        engine_id = engine.new_engine_id(request_id[:64])
        params, params_error = None, None
        try:
            params = sampling_params_from_proto(request.sampling)
        except ValueError as exc:
            params_error = exc
        carrier = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        operation = "chat" if request.WhichOneof("input") == "messages" else "text_completion"
        handle = self.observer.start(request_id, engine_id, CallInfo("grpc", "Generate", operation, carrier), params)
        status, message, final, stream = grpc.StatusCode.OK, "", None, None
        parsed: list[ChoiceOutput] | None = None  # chat with tools or reasoning: each sample's parse
        num_samples, num_finished, num_completion_tokens = 1, 0, 0
        try:
            try:
                if params_error is not None:
                    raise params_error
                prompt, messages = self._input(request)
                if messages is not None:
                    try:
                        plan, params = await self.chat_tools.prepare(engine, messages,
                                                                     tools_from_proto(request.messages), params, None)
                        stream = await self.chat_tools.generate(engine, request_id, params, plan, engine_id,
                                                                request.priority)
                    except ValueError as exc:
                        raise renamed(exc, CHAT_FIELDS) from None
                    if plan.tool_parser is not None or plan.reasoning is not None:
                        parsed = [plan.new_output() for _ in range(params.n)]
                else:
                    stream = await engine.generate(request_id, params, prompt=prompt, messages=messages,
                                                   priority=request.priority, engine_id=engine_id)
                num_samples = params.n
            except Exception as exc:
                refused = admission_status(exc)
                if refused is None:
                    raise
                status, message = refused, str(exc)
                await context.abort(status, message)
            async for out in stream:
                if out.finish_reason == "error":
                    final = out
                    status = failed_output_status(engine)
                    message = out.error or "engine error"
                    await context.abort(status, message)
                if out.is_finished:
                    final = out
                    num_finished += 1
                    num_completion_tokens += out.num_output_tokens
                if out.new_token_ids or out.is_finished:
                    ids = logprob_token_ids(out) if params.logprobs is not None or out.prompt_logprobs else []
                    texts = dict(zip(ids, await engine.token_texts(ids), strict=True)) if ids else None
                    is_last = out.is_finished and num_finished == num_samples
                    response = response_from_output(out, request_id, texts, num_completion_tokens if is_last else None)
                    if parsed is not None:
                        add_parsed(response, out, parsed, is_last)
                    yield response
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
            self.observer.finish(handle, final, None if status is grpc.StatusCode.OK else status.name, message,
                                 {"rpc.grpc.status_code": status.value[0]})

    @staticmethod
    def _input(request: pb.GenerateRequest) -> tuple[str | list[int] | None, list[dict[str, Any]] | None]:
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
        engine = await self._loaded_engine(context)
        return model_info_to_proto(engine.model_info())

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        engine = await self._loaded_engine(context)
        try:
            kind = request.WhichOneof("input")
            if kind == "prompt":
                if not request.prompt:
                    raise ValueError("prompt: must not be empty")
                ids = await engine.tokenize(prompt=request.prompt)
            elif kind == "messages":
                ids = await engine.tokenize(messages=messages_from_proto(request.messages))
            else:
                raise ValueError("input: one of prompt or messages is required")
        except LimitExceededError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.TokenizeResponse(token_ids=ids, count=len(ids),
                                   max_model_len=engine.model_info().max_model_len)
