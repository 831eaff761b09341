"""POST /v1/responses (and GET / DELETE /v1/responses/{id}): OpenAI's Responses API on the same
engine, chat template, tool grammar and parsers as chat completions. A response is one sample;
streamed as semantic events; stored (store, default true) in a bounded in-memory store so a
follow-up can name it as previous_response_id (an unknown id is a 400 naming that field)."""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from types import MappingProxyType
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from engine import FieldError, RequestOutput
from service.async_engine import EngineDeadError
from service.chat.output import ChoiceOutput
from service.observability.request_observer import CallInfo
from service.openai.call import AbortingStreamingResponse, until_disconnected
from service.openai.protocol import ChatCompletionRequest, UnsupportedFieldError, error_body, validation_field_error
from service.openai.request_checks import check_text
from service.openai.response_store import ResponseStore, StoredResponse
from service.openai.responses_protocol import (
    ResponseBuilder,
    ResponsesRequest,
    input_messages,
    output_messages,
    response_base,
)
from service.openai.tool_protocol import tool_request
from service.serving_state import EngineUnavailableError

# The chat request a response runs as names its fields as chat completions do; errors name the
# Responses API's own.
# Errors name the Responses API's own (FieldError.renamed: a path's leading part, and the fields a
# message mentions).
RESPONSES_FIELDS = MappingProxyType({
    "max_tokens": "max_output_tokens", "response_format": "text.format", "structured_output": "text.format",
    "structured_output.json_schema": "text.format.schema", "structured_output.json_object": "text.format",
    "messages": "input", "prompt": "input"})


class ResponsesApi:
    def __init__(self, door: Any, max_stored: int = 1024) -> None:
        """door: the OpenAIFrontDoor (engine state, model name, observer, chat planning)."""
        self.door = door
        self.store = ResponseStore(max_stored)

    def retrieve(self, response_id: str) -> JSONResponse:
        entry = self.store.get(response_id)
        if entry is None:
            return JSONResponse(error_body(f"response {response_id!r} not found", param="response_id",
                                           code="not_found"), status_code=404)
        return JSONResponse(entry.body)

    def delete(self, response_id: str) -> JSONResponse:
        if not self.store.delete(response_id):
            return JSONResponse(error_body(f"response {response_id!r} not found", param="response_id",
                                           code="not_found"), status_code=404)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    def _conversation(self, body: ResponsesRequest) -> list[dict[str, Any]]:
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            previous = self.store.get(body.previous_response_id)
            if previous is None:
                raise UnsupportedFieldError("previous_response_id",
                                            f"no stored response {body.previous_response_id!r} (unknown, not "
                                            "stored, or dropped from the store)")
            history = list(previous.conversation)
        return history + input_messages(body.input)

    async def create(self, body: ResponsesRequest, request: Any) -> Any:
        door = self.door
        door._check_model(body.model)
        response_id = f"resp_{uuid.uuid4().hex}"
        try:
            check_text(body)
            body.check_unserved()
            conversation = self._conversation(body)
            messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
            chat = ChatCompletionRequest(**ResponsesRequest.chat_body(body, messages))
            tools = tool_request(body.tools, body.tool_choice, body.parallel_tool_calls)
            params = chat.sampling_params()
            template_kwargs = body.template_kwargs()
        except ValidationError as exc:
            raise validation_field_error(exc).renamed(RESPONSES_FIELDS) from None
        except FieldError as exc:
            raise exc.renamed(RESPONSES_FIELDS) from None
        handle = door.observer.start(response_id, response_id, CallInfo("http", "/v1/responses", "chat",
                                                                        dict(request.headers), 1), params)
        try:
            engine = door.state.ready_engine(task="generate")
            plan, params = await door.chat_tools.prepare(engine, messages, tools, params, template_kwargs)
            stream = await door.chat_tools.generate(engine, response_id, params, plan)
        except (ValueError, EngineDeadError, EngineUnavailableError) as exc:
            # Admission: a field the client set (400, named as this API names it), the queue (429),
            # or the server's state (503), recorded as answered.
            error = door.admission_error(exc.renamed(RESPONSES_FIELDS) if isinstance(exc, FieldError) else exc)
            door.observer.finish(handle, None, str(error.status), error.message,
                                 {"http.response.status_code": error.status})
            raise error from exc
        except BaseException as exc:
            door.observer.finish(handle, None, "500", type(exc).__name__, {"http.response.status_code": 500})
            raise
        tools_body = [{"type": "function", "name": f.name, "description": f.description or None,
                       "parameters": f.parameters, "strict": f.strict} for f in tools.functions]
        call = ResponseCall(self, body, plan.new_output(engine.stop_sample), stream, ResponseBuilder(
            response_id, response_base(body, door.model_name, tools_body)), conversation, handle)
        if body.stream:
            return AbortingStreamingResponse(call.events(), media_type="text/event-stream",
                                              headers={"cache-control": "no-cache", "x-request-id": response_id})
        if not await until_disconnected(call.run(), request.receive):
            return JSONResponse(error_body("client disconnected"), status_code=499)
        if call.error is not None:
            return JSONResponse(error_body(call.error, "server_error"), status_code=500)
        return JSONResponse(call.final)


class ResponseCall:
    def __init__(self, api: ResponsesApi, body: ResponsesRequest, output: ChoiceOutput,
                 stream: AsyncIterator[RequestOutput], builder: ResponseBuilder, conversation: list[dict[str, Any]],
                 handle: Any) -> None:
        """output: the answer's parse (ChatPlan.new_output)."""
        self.api, self.body, self.stream, self.builder = api, body, stream, builder
        self.conversation, self.handle = conversation, handle
        self.output = output
        self.final: dict[str, Any] | None = None
        self.error: str | None = None

    async def run(self) -> bool:
        """The whole response, unstreamed (self.final, or self.error); True once it has ended."""
        async for _ in self.events():
            pass
        return True

    async def events(self) -> AsyncIterator[str]:
        builder, last = self.builder, None
        error_type, status = None, 200
        try:
            yield builder.event("response.created", response=builder.response("in_progress"))
            yield builder.event("response.in_progress", response=builder.response("in_progress"))
            async for out in self.stream:
                last = out
                if out.finish_reason == "error":
                    self.error, error_type, status = out.error or "engine error", "500", 500
                    yield builder.event("response.failed", response={
                        **builder.response("failed"), "error": {"code": "server_error", "message": self.error}})
                    return
                for event in builder.add(self.output.feed(out)):
                    yield event
            # OpenAI's statuses: incomplete (incomplete_details says why) when max_output_tokens
            # cut the answer, cancelled when it was aborted (a drain, an abort by id); an answer a
            # repeated call ended is complete (its calls), however the engine then stopped.
            status, incomplete = {"length": ("incomplete", "max_output_tokens"), "abort": ("cancelled", None)}.get(
                self.output.finish_reason(last.finish_reason) or "", ("completed", None))
            for event in builder.close(is_cut=status != "completed"):
                yield event
            usage = {"input_tokens": last.num_prompt_tokens, "output_tokens": last.num_output_tokens,
                     "total_tokens": last.num_prompt_tokens + last.num_output_tokens,
                     "input_tokens_details": {"cached_tokens": last.num_cached_tokens},
                     "output_tokens_details": {"reasoning_tokens": self.output.num_reasoning_tokens}}
            self.final = builder.response(status, usage, incomplete)
            if self.body.store:
                self.api.store.put(builder.id, StoredResponse(
                    self.final, self.conversation + output_messages(self.final["output"])))
            # No stream event is named for a cancelled response: it ends as an unfinished one does.
            yield builder.event("response.completed" if status == "completed" else "response.incomplete",
                                response=self.final)
        except asyncio.CancelledError:
            error_type, status = "499", 499
            raise
        finally:
            await self.stream.aclose()
            self.api.door.observer.finish(self.handle, last, error_type, self.error or "",
                                          {"http.response.status_code": status})
