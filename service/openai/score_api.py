"""POST /rerank and /score (service/openai/score_protocol.py has their shapes): each
query-document pair one score request in the engine (prefill only, batched with everything
else; service/score_prompts.py puts the pair together as the model reads it), answered together.

Refused by field (HTTP 400 with `param`): an empty `query`, `documents` or `text_1`/`text_2` (or
an empty one of them), more than 1000 documents, `top_n` below 1, lists of `text_1` and `text_2`
that do not pair, a pair over the context (named by its document). A model served for another
task answers 400 (`param` `model`: serve it with `--task score`), as a score server does on the
generation and embedding routes. A client that disconnects aborts every pair's request.
"""
from __future__ import annotations

import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from engine import PoolingParams
from service.observability.request_observer import CallInfo
from service.openai.pooling_call import pooled_outputs
from service.openai.request_checks import check_text
from service.openai.score_protocol import RerankRequest, ScoreRequest
from service.pooling_batch import PoolingBatch
from service.score_prompts import score_prompts


class ScoreApi:
    def __init__(self, door: Any) -> None:
        """door: the OpenAIFrontDoor (its state, model name, observer, error mapping)."""
        self.door = door

    async def create(self, body: RerankRequest | ScoreRequest, request: Request, route: str) -> JSONResponse:
        door = self.door
        is_rerank = isinstance(body, RerankRequest)
        request_id = f"{'rerank' if is_rerank else 'score'}-{uuid.uuid4().hex}"
        handle = door.observer.start(request_id, request_id, CallInfo("http", route, "rerank" if is_rerank else "score",
                                                                      dict(request.headers)), None)

        async def admit() -> PoolingBatch:
            door._check_model(body.model)
            check_text(body)
            pairs = body.pairs()
            engine = door.state.ready_engine(task="score")
            prompts = await score_prompts(engine, pairs, body.instruction)
            batch = PoolingBatch(engine, request_id)
            await batch.admit(PoolingParams(task="score"), [p.token_ids for p in prompts], body.priority,
                              body.pair_field, [p.token_type_ids for p in prompts])
            return batch

        outputs = await pooled_outputs(door, request, handle, admit, "a score")
        if isinstance(outputs, JSONResponse):
            return outputs
        return JSONResponse(body.answer(request_id, door.model_name, outputs), headers={"x-request-id": request_id})
