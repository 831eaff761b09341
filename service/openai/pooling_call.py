"""The part of a pooling route (embeddings, rerank, score) after its body is read: admit the
batch (errors become the door's 4xx/5xx, recorded once), wait for every output or the client to
leave (499, every request aborted), and refuse a batch with a failed member (500)."""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from engine import RequestOutput
from service.async_engine import EngineDeadError
from service.openai.call import until_disconnected
from service.pooling_batch import PoolingBatch, failed_output
from service.serving_state import EngineUnavailableError


async def pooled_outputs(door: Any, request: Request, handle: Any, admit: Callable[[], Awaitable[PoolingBatch]],
                         what: str) -> list[RequestOutput] | JSONResponse:
    """admit: checks the body and admits its batch (ValueError for bad input). Returns the
    batch's outputs in order, or the 499 response when the client left. what: the output's
    name in a failure's message ("an embedding", "a score")."""
    try:
        batch = await admit()
    except (ValueError, EngineDeadError, EngineUnavailableError, door.api_error) as exc:
        error = exc if isinstance(exc, door.api_error) else door.admission_error(exc)
        door.observer.finish(handle, None, str(error.status), error.message, {"http.response.status_code": error.status})
        raise error from exc
    try:
        outputs = await until_disconnected(batch.finals(), request.receive)
    finally:
        await batch.aclose()
    if outputs is None:  # the client left: every member's request is aborted
        door.observer.finish(handle, None, "499", "client disconnected", {"http.response.status_code": 499})
        return JSONResponse({}, status_code=499)
    failed = failed_output(outputs)
    if failed is not None:
        message = failed.error or f"the request ended without {what} ({failed.finish_reason})"
        door.observer.finish(handle, failed, "500", message, {"http.response.status_code": 500})
        raise door.api_error(500, message, "server_error")
    door.observer.finish(handle, outputs[-1], None, attributes={"http.response.status_code": 200})
    return outputs
