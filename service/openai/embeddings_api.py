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

from service.observability.request_observer import CallInfo
from service.openai.embeddings_protocol import EmbeddingRequest
from service.openai.pooling_call import pooled_outputs
from service.pooling_batch import PoolingBatch

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

        async def admit() -> PoolingBatch:
            door._check_model(body.model)
            prompts = body.inputs()
            params = body.pooling_params()
            batch = PoolingBatch(door.state.ready_engine(task="embed"), request_id)
            await batch.admit(params, prompts, body.priority, lambda i: body.input_field(i, len(prompts)))
            return batch

        outputs = await pooled_outputs(door, request, handle, admit, "an embedding")
        if isinstance(outputs, JSONResponse):
            return outputs
        return JSONResponse(body.answer(door.model_name, outputs), headers={"x-request-id": request_id})
