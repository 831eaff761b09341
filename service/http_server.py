"""The OpenAI-compatible HTTP front door: FastAPI on uvicorn, on the gRPC server's event loop.

Routes: POST /v1/completions, POST /v1/chat/completions (streamed as server-sent events or
whole), GET /v1/models, GET /health. Both front doors share the engine, the serving state (a
drain or a dead engine refuses new calls on both), the bearer tokens, the request observer
(traces) and the call metrics (`protocol="http"`). A client that disconnects aborts its
request, which frees its KV blocks at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import ClientDisconnect

from engine import LimitExceededError, QueueFullError, RequestIdInUseError, RequestOutput, SamplingParams
from service.async_engine import AsyncEngine, EngineDeadError
from service.openai_protocol import (
    ChatCompletionRequest,
    ChoiceLogprobs,
    CompletionRequest,
    UnsupportedFieldError,
    error_body,
    finish_reason,
    now,
    param_of,
    usage_body,
)
from service.request_observer import CallInfo, RequestObserver
from service.serving_state import EngineUnavailableError, ServingState

logger = logging.getLogger(__name__)

ApiCallListener = Callable[[str, str, str, float], None]  # (protocol, method, code, seconds)
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health")


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.kind, self.param, self.code), status_code=self.status)


def _admission_error(exc: Exception) -> ApiError:
    """The HTTP status of an admission failure (the gRPC front door maps the same errors)."""
    if isinstance(exc, QueueFullError):
        return ApiError(429, str(exc), "rate_limit_error")
    if isinstance(exc, RequestIdInUseError):
        return ApiError(409, str(exc), param="request_id")
    if isinstance(exc, (EngineDeadError, EngineUnavailableError)):
        return ApiError(503, str(exc), "service_unavailable")
    if isinstance(exc, UnsupportedFieldError):
        return ApiError(400, str(exc), param=exc.param)
    if isinstance(exc, (LimitExceededError, ValueError)):
        return ApiError(400, str(exc), param=param_of(str(exc)))
    raise exc


class CallMiddleware:
    """Pure ASGI middleware: refuses bodies over the size limit, times every call to its last
    body byte (a stream's whole life) and reports its final status (499: the client left first)."""

    def __init__(self, app: Any, listener: ApiCallListener | None, max_body_bytes: int) -> None:
        self.app, self.listener, self.max_body_bytes = app, listener, max_body_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.monotonic(), [0]
        length = dict(scope.get("headers") or ()).get(b"content-length", b"")
        app = self.app
        if length.isdigit() and int(length) > self.max_body_bytes:
            app = ApiError(413, f"body: {int(length)} bytes, at most {self.max_body_bytes}").response()

        async def observed_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await app(scope, receive, observed_send)
        except BaseException:
            status[0] = status[0] or 500
            raise
        finally:
            if self.listener is not None:
                route = scope["path"] if scope["path"] in ROUTES else "other"
                self.listener("http", route, str(status[0] or 499), time.monotonic() - start)


class OpenAIFrontDoor:
    def __init__(self, state: ServingState, model_name: str, observer: RequestObserver | None = None,
                 auth_tokens: list[str] | None = None, max_body_bytes: int = 4 * 1024 * 1024,
                 on_call: ApiCallListener | None = None) -> None:
        self.state = state
        self.model_name = model_name
        self.observer = observer or RequestObserver()
        self.auth_tokens = list(auth_tokens or [])
        self.max_body_bytes = max_body_bytes
        self.app = self._build_app()
        self.asgi = CallMiddleware(self.app, on_call, max_body_bytes)

    # ---- app ---------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="minivllm OpenAI-compatible API", docs_url=None, redoc_url=None)

        @app.exception_handler(ApiError)
        async def api_error(_: Request, exc: ApiError) -> JSONResponse:
            return exc.response()

        @app.exception_handler(RequestValidationError)
        async def invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
            first = exc.errors()[0] if exc.errors() else {}
            loc = [str(p) for p in first.get("loc", ()) if p != "body"]
            param = ".".join(loc) or None
            message = f"{param}: {first.get('msg', 'invalid body')}" if param else first.get("msg", "invalid body")
            return JSONResponse(error_body(message, param=param), status_code=400)

        auth = Depends(self._check_token)

        @app.get("/health")
        async def health() -> JSONResponse:
            try:
                self.state.ready_engine()
            except EngineUnavailableError as exc:
                return JSONResponse({"status": str(exc)}, status_code=503)
            return JSONResponse({"status": "ok"})

        @app.get("/v1/models", dependencies=[auth])
        async def models() -> dict[str, Any]:
            engine = self._loaded()
            info = engine.engine.model_info()
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": now(),
                                                "owned_by": "minivllm", "max_model_len": info.max_model_len}]}

        @app.post("/v1/completions", dependencies=[auth])
        async def completions(body: CompletionRequest, request: Request) -> Any:
            return await self._serve(body, request, "text_completion", "/v1/completions")

        @app.post("/v1/chat/completions", dependencies=[auth])
        async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
            return await self._serve(body, request, "chat", "/v1/chat/completions")

        return app

    async def _check_token(self, request: Request) -> None:
        if not self.auth_tokens:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not any(secrets.compare_digest(token.strip(), t) for t in self.auth_tokens):
            raise ApiError(401, "missing or invalid bearer token", "authentication_error", code="invalid_api_key")

    def _loaded(self) -> AsyncEngine:
        try:
            return self.state.loaded_engine()
        except EngineUnavailableError as exc:
            raise ApiError(503, str(exc), "service_unavailable") from exc

    # ---- generation ---------------------------------------------------------------------

    async def _serve(self, body: CompletionRequest | ChatCompletionRequest, request: Request, operation: str,
                     route: str) -> Any:
        is_chat = isinstance(body, ChatCompletionRequest)
        request_id = f"{'chatcmpl' if is_chat else 'cmpl'}-{uuid.uuid4().hex}"
        params, params_error = None, None
        try:
            params = body.sampling_params()
        except ValueError as exc:
            params_error = exc
        handle = self.observer.start(request_id, request_id, CallInfo("http", route, operation, dict(request.headers),
                                                                      body.n), params)
        try:
            if body.model not in (None, "", self.model_name):
                raise ApiError(404, f"model: {body.model!r} is not served here (this server serves "
                                    f"{self.model_name!r})", param="model", code="model_not_found")
            if params_error is not None:
                raise params_error
            engine = self.state.ready_engine()
            if is_chat:
                stream = await engine.generate(request_id, params, messages=body.chat_messages(), engine_id=request_id)
            else:
                stream = await engine.generate(request_id, params, prompt=body.prompt_input(), engine_id=request_id)
        except ApiError as exc:
            self.observer.finish(handle, None, str(exc.status), exc.message, {"http.response.status_code": exc.status})
            raise
        except (ValueError, EngineDeadError, EngineUnavailableError) as exc:
            error = _admission_error(exc)
            self.observer.finish(handle, None, str(error.status), error.message,
                                 {"http.response.status_code": error.status})
            raise error from exc
        call = _Call(self, engine, stream, body, params, request_id, handle)
        if body.stream:
            return _AbortingStreamingResponse(call.events(), media_type="text/event-stream",
                                              headers={"cache-control": "no-cache", "x-request-id": request_id})
        return await call.whole(request)


class _AbortingStreamingResponse(StreamingResponse):
    """Stops the event generator (which aborts the request) as soon as the client disconnects,
    even while no token is due (a long prefill), and always closes it: never left to the GC."""

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        respond = asyncio.ensure_future(super().__call__(scope, receive, send))
        disconnect = asyncio.ensure_future(_disconnected(receive))
        try:
            done, _ = await asyncio.wait({respond, disconnect}, return_when=asyncio.FIRST_COMPLETED)
            if respond not in done:
                respond.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await respond
            else:
                with contextlib.suppress(ClientDisconnect, OSError):
                    respond.result()
        finally:
            disconnect.cancel()
            await self.body_iterator.aclose()


class _Call:
    """One admitted request: its engine stream rendered as SSE chunks or as one JSON body, with
    one choice per sample (n > 1: `index` tells them apart; usage counts the prompt once)."""

    def __init__(self, door: OpenAIFrontDoor, engine: AsyncEngine, stream: AsyncIterator[RequestOutput],
                 body: CompletionRequest | ChatCompletionRequest, params: SamplingParams, request_id: str,
                 handle: Any) -> None:
        self.door, self.engine, self.stream, self.body = door, engine, stream, body
        self.params, self.request_id, self.handle = params, request_id, handle
        self.is_chat = isinstance(body, ChatCompletionRequest)
        self.top_n = (body.top_logprobs or 0) if self.is_chat else (body.logprobs or 0)
        self.created = now()
        self.text_offsets = [0] * params.n
        self.finals: dict[int, RequestOutput] = {}

    @contextlib.contextmanager
    def _observed(self) -> Iterator[list[Any]]:
        """Reports the outcome to the observer whatever happens; yields a [final output] cell."""
        final: list[Any] = [None]
        error_type, message, status = None, "", 200
        try:
            yield final
            out = final[0]
            if out is not None and out.finish_reason == "error":
                error_type, message, status = "500", out.error or "engine error", 500
        except asyncio.CancelledError:
            error_type, message, status = "499", "client disconnected", 499
            raise
        except BaseException as exc:
            error_type, message, status = "500", type(exc).__name__, 500
            raise
        finally:
            self.door.observer.finish(self.handle, final[0], error_type, message, {"http.response.status_code": status})

    def _usage(self) -> dict[str, Any]:
        body = usage_body(self.finals[0] if 0 in self.finals else next(iter(self.finals.values())))
        body["completion_tokens"] = sum(o.num_output_tokens for o in self.finals.values())
        body["total_tokens"] = body["prompt_tokens"] + body["completion_tokens"]
        return body

    async def _logprobs(self, out: RequestOutput) -> dict[str, Any] | None:
        if self.params.logprobs is None or not out.new_logprobs:
            return None
        ids = ChoiceLogprobs.ids(out, self.top_n)
        texts = dict(zip(ids, await self.engine.token_texts(ids), strict=True))
        if self.is_chat:
            return ChoiceLogprobs.chat(out, self.top_n, texts)
        entry = ChoiceLogprobs.completion(out, self.top_n, texts, self.text_offsets[out.index])
        self.text_offsets[out.index] += len(out.new_text)
        return entry

    async def _prompt_logprobs(self, out: RequestOutput) -> list[Any] | None:
        """vLLM's layout: per prompt token, None for the first, else token id -> {logprob, rank, decoded_token}."""
        if not out.prompt_logprobs:
            return None
        ids = sorted({t for entry in out.prompt_logprobs if entry for t in entry})
        texts = dict(zip(ids, await self.engine.token_texts(ids), strict=True))
        result: list[Any] = []
        for entry in out.prompt_logprobs:
            if entry is None:
                result.append(None)
                continue
            ranked = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)
            result.append({str(t): {"logprob": v, "rank": r + 1, "decoded_token": texts[t]}
                           for r, (t, v) in enumerate(ranked)})
        return result

    def _chunk(self, choice: dict[str, Any], usage: dict[str, Any] | None = None) -> str:
        kind = "chat.completion.chunk" if self.is_chat else "text_completion"
        payload: dict[str, Any] = {"id": self.request_id, "object": kind, "created": self.created,
                                   "model": self.door.model_name, "choices": [choice] if choice else []}
        if usage is not None:
            payload["usage"] = usage
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    async def events(self) -> AsyncIterator[str]:
        """Server-sent events; the client going away cancels this generator, which aborts the request."""
        with self._observed() as final:
            try:
                if self.is_chat:
                    for index in range(self.params.n):
                        yield self._chunk({"index": index, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None})
                async for out in self.stream:
                    if out.finish_reason == "error":
                        final[0] = out
                        yield f"data: {json.dumps(error_body(out.error or 'engine error', 'server_error'))}\n\n"
                        return
                    if out.is_finished:
                        final[0] = out
                        self.finals[out.index] = out
                    logprobs = await self._logprobs(out)
                    prompt_logprobs = await self._prompt_logprobs(out)
                    if out.new_text or logprobs or prompt_logprobs or out.is_finished:
                        if self.is_chat:
                            delta = {"content": out.new_text} if out.new_text else {}
                            choice = {"index": out.index, "delta": delta, "logprobs": logprobs,
                                      "finish_reason": finish_reason(out)}
                        else:
                            choice = {"index": out.index, "text": out.new_text, "logprobs": logprobs,
                                      "finish_reason": finish_reason(out)}
                        if prompt_logprobs is not None:
                            choice["prompt_logprobs"] = prompt_logprobs
                        yield self._chunk(choice)
                if self.body.include_usage and self.finals:
                    yield self._chunk({}, self._usage())
                yield "data: [DONE]\n\n"
            finally:
                await self.stream.aclose()  # aborts an unfinished request: frees its KV blocks now

    async def whole(self, request: Request) -> JSONResponse:
        """Collects the whole answer; a client that disconnects first aborts the request."""
        collect = asyncio.ensure_future(self._collect())
        disconnect = asyncio.ensure_future(_disconnected(request.receive))
        try:
            done, _ = await asyncio.wait({collect, disconnect}, return_when=asyncio.FIRST_COMPLETED)
            if collect not in done:
                collect.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await collect
                return JSONResponse(error_body("client disconnected"), status_code=499)
            return collect.result()
        finally:
            disconnect.cancel()

    async def _collect(self) -> JSONResponse:
        n = self.params.n
        with self._observed() as final:
            texts: list[list[str]] = [[] for _ in range(n)]
            prompt_logprobs: list[Any] | None = None
            chat_logprobs: list[list[dict[str, Any]]] = [[] for _ in range(n)]
            completion_logprobs: list[dict[str, list[Any]]] = [{} for _ in range(n)]
            try:
                async for out in self.stream:
                    if out.finish_reason == "error":
                        final[0] = out
                        return JSONResponse(error_body(out.error or "engine error", "server_error"), status_code=500)
                    texts[out.index].append(out.new_text)
                    prompt_logprobs = prompt_logprobs or await self._prompt_logprobs(out)
                    logprobs = await self._logprobs(out)
                    if logprobs is not None and self.is_chat:
                        chat_logprobs[out.index].extend(logprobs["content"])
                    elif logprobs is not None:
                        for key, values in logprobs.items():
                            completion_logprobs[out.index].setdefault(key, []).extend(values)
                    if out.is_finished:
                        final[0] = out
                        self.finals[out.index] = out
            finally:
                await self.stream.aclose()
            choices = []
            for index in range(n):
                logprobs_body: Any = None
                if self.params.logprobs is not None:
                    logprobs_body = {"content": chat_logprobs[index]} if self.is_chat else completion_logprobs[index]
                reason = finish_reason(self.finals[index]) if index in self.finals else None
                if self.is_chat:
                    choice = {"index": index, "message": {"role": "assistant", "content": "".join(texts[index])},
                              "logprobs": logprobs_body, "finish_reason": reason}
                else:
                    choice = {"index": index, "text": "".join(texts[index]), "logprobs": logprobs_body,
                              "finish_reason": reason}
                if index == 0 and prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs
                choices.append(choice)
            kind = "chat.completion" if self.is_chat else "text_completion"
            return JSONResponse({"id": self.request_id, "object": kind, "created": self.created,
                                 "model": self.door.model_name, "choices": choices, "usage": self._usage()})


async def _disconnected(receive: Callable) -> None:
    """Returns when the client has gone away (the body is already read, so only that can arrive)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class _EmbeddedServer(uvicorn.Server):
    """uvicorn sharing the gRPC server's loop: signals stay with InferenceServer, which drains both."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    def __init__(self, door: OpenAIFrontDoor, host: str, port: int) -> None:
        self.config = uvicorn.Config(door.asgi, host=host, port=port, log_level="warning", access_log=False,
                                     lifespan="off", timeout_graceful_shutdown=5)
        self.server = _EmbeddedServer(self.config)
        self._task: asyncio.Task | None = None
        # Bound here, not by uvicorn (which exits the process when a port is taken): an OSError
        # reaches the caller, and port 0 gives a free port that `port` then reads back.
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((host, port))
        except OSError:
            self.socket.close()
            raise
        self.socket.set_inheritable(True)
        self.port = self.socket.getsockname()[1]

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self.server.serve(sockets=[self.socket]))
        while not self.server.started:
            if self._task.done():
                self._task.result()
                raise OSError(f"HTTP server on {self.config.host}:{self.port} did not start")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._task is None:
            return
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
