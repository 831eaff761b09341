"""The Inference service: validates requests, feeds the engine thread, streams deltas."""
from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from types import MappingProxyType
from typing import Any

import grpc

from engine import FieldError, LimitExceededError, PoolingParams, RequestOutput, SamplingParams
from service.async_engine import AsyncEngine
from service.chat.output import ChoiceOutput
from service.chat.tools import ChatTools
from service.grpc.generate_stream import Admitted, GenerateIds, call_info, generate_stream
from service.grpc.minivllm_protocol import (
    add_parsed,
    embed_input_field,
    embed_inputs_from_proto,
    embed_response,
    logprob_token_ids,
    messages_from_proto,
    model_info_to_proto,
    pooling_params_from_proto,
    response_from_output,
    sampling_params_from_proto,
    score_pairs_from_proto,
    score_response,
    template_kwargs_from_proto,
    tools_from_proto,
)
from service.grpc.status import admission_status, failed_output_status, serving_engine
from service.observability.request_observer import RequestObserver
from service.pb import inference_pb2 as pb
from service.pb import inference_pb2_grpc as pb_grpc
from service.pooling_batch import PoolingBatch, failed_output
from service.score_prompts import score_prompts
from service.serving_state import ServingState

__all__ = ["InferenceServicer", "RequestObserver"]

logger = logging.getLogger(__name__)

# The chat planning names chat-completion fields; on this door they sit in the request's messages
# and sampling (FieldError.renamed: a path's leading part, and the fields a message mentions).
CHAT_FIELDS = MappingProxyType({"tools": "messages.tools", "tool_choice": "messages.tool_choice",
                                "stop": "sampling.stop", "response_format": "sampling.structured_output",
                                "chat_template_kwargs": "messages.chat_template_kwargs"})


class MinivllmResponses:
    """One call's minivllm.v1 messages, an engine output each: logprobs with their tokens' texts,
    a chat's parse, and usage (all samples' tokens) on the last sample's last message."""

    def __init__(self, engine: AsyncEngine, request_id: str, params: SamplingParams,
                 parsed: list[ChoiceOutput] | None) -> None:
        self.engine, self.request_id, self.params, self.parsed = engine, request_id, params, parsed
        self.num_finished, self.num_completion_tokens = 0, 0

    async def respond(self, out: RequestOutput) -> AsyncIterator[pb.GenerateResponse]:
        if out.is_finished:
            self.num_finished += 1
            self.num_completion_tokens += out.num_output_tokens
        if not (out.new_token_ids or out.is_finished):
            return
        ids = logprob_token_ids(out) if self.params.logprobs is not None or out.prompt_logprobs else []
        texts = dict(zip(ids, await self.engine.token_texts(ids), strict=True)) if ids else None
        is_last = out.is_finished and self.num_finished == self.params.n
        response = response_from_output(out, self.request_id, texts, self.num_completion_tokens if is_last else None)
        if self.parsed is not None:
            add_parsed(response, out, self.parsed, is_last)
        yield response


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
        return await serving_engine(self.state, context)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        engine = await serving_engine(self.state, context, for_new_request=True, task="generate")
        ids = GenerateIds.of(engine, request.request_id)
        operation = "chat" if request.WhichOneof("input") == "messages" else "text_completion"

        async def admit(params: SamplingParams) -> Admitted[pb.GenerateResponse]:
            prompt, messages = self._input(request)
            parsed: list[ChoiceOutput] | None = None  # chat with tools or reasoning: each sample's parse
            if messages is not None:
                try:
                    plan, params = await self.chat_tools.prepare(engine, messages, tools_from_proto(request.messages),
                                                                 params, template_kwargs_from_proto(request.messages))
                    outputs = await self.chat_tools.generate(engine, ids.request_id, params, plan, ids.engine_id,
                                                             request.priority)
                except FieldError as exc:
                    raise exc.renamed(CHAT_FIELDS) from None
                if plan.is_parsed:
                    parsed = [plan.new_output(engine.stop_sample) for _ in range(params.n)]
            else:
                outputs = await engine.generate(ids.request_id, params, prompt=prompt, messages=messages,
                                                priority=request.priority, engine_id=ids.engine_id)
            return Admitted(outputs, MinivllmResponses(engine, ids.request_id, params, parsed).respond)

        responses = generate_stream(context, engine, self.observer, call_info("grpc", operation, context), ids,
                                    lambda: sampling_params_from_proto(request.sampling), admit)
        # aclosing: a call dropped between two messages closes the shared loop now, which closes
        # the engine stream (its KV blocks freed) and tells the observer.
        async with contextlib.aclosing(responses):
            async for response in responses:
                yield response

    @staticmethod
    def _input(request: pb.GenerateRequest) -> tuple[str | list[int] | None, list[dict[str, Any]] | None]:
        kind = request.WhichOneof("input")
        if kind == "prompt":
            if not request.prompt:
                raise FieldError("prompt", "must not be empty")
            return request.prompt, None
        if kind == "prompt_token_ids":
            if not request.prompt_token_ids.ids:
                raise FieldError("prompt_token_ids", "must not be empty")
            return list(request.prompt_token_ids.ids), None
        if kind == "messages":
            return None, messages_from_proto(request.messages)
        raise FieldError("input", "one of prompt, prompt_token_ids or messages is required")

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        engine = await self._loaded_engine(context)
        return model_info_to_proto(engine.model_info())

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        engine = await self._loaded_engine(context)
        try:
            kind = request.WhichOneof("input")
            if kind == "prompt":
                if not request.prompt:
                    raise FieldError("prompt", "must not be empty")
                ids = await engine.tokenize(prompt=request.prompt)
            elif kind == "messages":  # as Generate renders them (tools, template kwargs, Harmony)
                ids = await self.chat_tools.prompt_ids(engine, messages_from_proto(request.messages),
                                                       tools_from_proto(request.messages),
                                                       template_kwargs_from_proto(request.messages))
            else:
                raise FieldError("input", "one of prompt or messages is required")
        except LimitExceededError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.TokenizeResponse(token_ids=ids, count=len(ids),
                                   max_model_len=engine.model_info().max_model_len)

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        async def admit(engine: AsyncEngine, batch: PoolingBatch) -> None:
            await batch.admit(pooling_params_from_proto(request), embed_inputs_from_proto(request), request.priority,
                              lambda i: embed_input_field(request, i))

        return await self._pooling_call(request, context, "embed", "embeddings", "Embed", admit, embed_response)

    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        """Each document against the query as one score request (service/score_prompts.py puts the
        pair together as the model reads it), as /rerank's are."""
        async def admit(engine: AsyncEngine, batch: PoolingBatch) -> None:
            prompts = await score_prompts(engine, score_pairs_from_proto(request), request.instruction or None)
            await batch.admit(PoolingParams(task="score"), [p.token_ids for p in prompts], request.priority,
                              lambda i: f"documents[{i}]", [p.token_type_ids for p in prompts])

        return await self._pooling_call(request, context, "score", "rerank", "Score", admit, score_response)

    async def _pooling_call(self, request: Any, context: grpc.aio.ServicerContext, task: str, operation: str,
                            method: str, admit: Callable[[AsyncEngine, PoolingBatch], Awaitable[None]],
                            response: Callable[[str, list[RequestOutput]], Any]) -> Any:
        """One call's inputs as pooling requests of `task` (admit puts them in the batch), read to
        their finals together and answered by response(request_id, outputs); a refusal's status
        names the field, a failed input fails the call."""
        engine = await serving_engine(self.state, context, for_new_request=True, task=task)
        ids = GenerateIds.of(engine, request.request_id)
        handle = self.observer.start(ids.request_id, ids.engine_id, call_info("grpc", operation, context, method),
                                     None)
        status, message, outputs = grpc.StatusCode.OK, "", None
        batch = PoolingBatch(engine, ids.engine_id)
        try:
            try:
                await admit(engine, batch)
            except Exception as exc:  # noqa: BLE001 - a refusal's status, or re-raised
                status = admission_status(exc)
                if status is None:
                    raise
                message = str(exc)
                await context.abort(status, message)
            outputs = await batch.finals()
            failed = failed_output(outputs)
            if failed is not None:
                status, message = failed_output_status(engine), failed.error or "engine error"
                await context.abort(status, message)
            return response(ids.request_id, outputs)
        except BaseException as exc:
            if status is grpc.StatusCode.OK:
                status, message = grpc.StatusCode.CANCELLED, type(exc).__name__
            raise
        finally:
            await batch.aclose()
            self.observer.finish(handle, outputs[-1] if outputs else None,
                                 None if status is grpc.StatusCode.OK else status.name, message,
                                 {"rpc.grpc.status_code": status.value[0]})
