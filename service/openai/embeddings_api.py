"""POST /v1/embeddings: each input one pooling request in the engine (prefill only, batched
with everything else), answered together in input order.

Refused by field (HTTP 400 with `param`): an empty or oversized `input` (or `input[i]`), token
ids outside the vocabulary, a prompt over the context, an unknown `encoding_format`,
`dimensions` below 1 or over the model's. A model served for generation answers 400 here, as
vLLM's does (serve it with `--task embed`). A client that disconnects aborts every input's
request, freeing their blocks.
"""
from __future__ import annotations

import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from service.async_engine import EngineDeadError
from service.observability.request_observer import CallInfo
from service.openai.call import until_disconnected
from service.openai.embeddings_protocol import EmbeddingRequest
from service.pooling_batch import PoolingBatch, failed_output
from service.serving_state import EngineUnavailableError

ROUTE = "/v1/embeddings"


class EmbeddingsApi:
    def __init__(self, door: Any) -> None:
        """door: the OpenAIFrontDoor (its state, model name, observer, error mapping)."""
        self.door = door

    async def create(self, body: EmbeddingRequest, request: Request) -> JSONResponse:
        door = self.door
        request_id = f"embd-{uuid.uuid4().hex}"
        handle = door.observer.start(request_id, request_id, CallInfo("http", ROUTE, "embeddings",
                                                                      dict(request.headers)), None)
        try:
            door._check_model(body.model)
            prompts = body.inputs()
            params = body.pooling_params()
            engine = door.state.ready_engine(task="embed")
            batch = PoolingBatch(engine, request_id)
            await batch.admit(params, prompts, body.priority, lambda i: body.input_field(i, len(prompts)))
        except (ValueError, EngineDeadError, EngineUnavailableError, door.api_error) as exc:
            error = exc if isinstance(exc, door.api_error) else door.admission_error(exc)
            door.observer.finish(handle, None, str(error.status), error.message,
                                 {"http.response.status_code": error.status})
            raise error from exc
        try:
            outputs = await until_disconnected(batch.finals(), request.receive)
        finally:
            await batch.aclose()
        if outputs is None:  # the client left: every input's request is aborted
            door.observer.finish(handle, None, "499", "client disconnected", {"http.response.status_code": 499})
            return JSONResponse({}, status_code=499)
        failed = failed_output(outputs)
        if failed is not None:
            message = failed.error or f"the request ended without an embedding ({failed.finish_reason})"
            door.observer.finish(handle, failed, "500", message, {"http.response.status_code": 500})
            raise door.api_error(500, message, "server_error")
        door.observer.finish(handle, outputs[-1], None, attributes={"http.response.status_code": 200})
        return JSONResponse(body.answer(door.model_name, outputs), headers={"x-request-id": request_id})
