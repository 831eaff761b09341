"""The OpenAI-compatible HTTP front door: the FastAPI app (routes, auth, errors, call metrics).

Routes: POST /v1/completions, POST /v1/chat/completions (streamed as server-sent events or
whole; tools and reasoning: service/chat/tools.py), POST /v1/responses with GET and DELETE
/v1/responses/{id} (service/openai/responses_api.py), POST /v1/embeddings (service/openai/embeddings_api.py),
POST /rerank (/v1/rerank, /v2/rerank) and /score (/v1/score) (service/openai/score_api.py),
GET /v1/models, GET /health, and vLLM's POST /tokenize, POST /detokenize and GET
/tokenizer_info (lm-evaluation-harness's remote tokenizer uses the three). Both front doors
share the engine, the serving state (a drain or a dead engine refuses new calls on both), the
bearer tokens, the request observer (traces) and the call metrics (`protocol="http"`). A client
that disconnects aborts its request, which frees its KV blocks at once.
"""
from __future__ import annotations

import logging
import secrets
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from engine import FieldError, QueueFullError, RequestIdInUseError, RequestOutput, SamplingParams
from service.async_engine import AsyncEngine, EngineDeadError
from service.chat.tools import ChatTools, check_template_kwargs
from service.observability.request_observer import CallInfo, RequestObserver
from service.openai.call import AbortingStreamingResponse, OpenAICall
from service.openai.embeddings_api import EmbeddingsApi
from service.openai.embeddings_protocol import EmbeddingRequest
from service.openai.http_guard import ApiCallListener, CallMiddleware
from service.openai.output_merge import MergedOutputs
from service.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    field_path,
    now,
)
from service.openai.request_checks import check_text, engine_field_names
from service.openai.responses_api import ResponsesApi
from service.openai.responses_protocol import ResponsesRequest
from service.openai.score_api import ScoreApi
from service.openai.score_protocol import RerankRequest, ScoreRequest
from service.serving_state import EngineUnavailableError, ServingState, TaskNotServedError

logger = logging.getLogger(__name__)


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
    if isinstance(exc, TaskNotServedError):
        return ApiError(400, str(exc), param="model", code="model_not_supported")
    if isinstance(exc, FieldError):  # LimitExceededError included: a request over a limit is the client's to fix
        return ApiError(400, str(exc), param=exc.field)
    if isinstance(exc, ValueError):
        return ApiError(400, str(exc))
    raise exc


class OpenAIFrontDoor:
    admission_error = staticmethod(_admission_error)  # for the Responses and embeddings APIs' own admission
    api_error = ApiError

    def __init__(self, state: ServingState, model_name: str, observer: RequestObserver | None = None,
                 auth_tokens: list[str] | None = None, max_body_bytes: int = 4 * 1024 * 1024,
                 on_call: ApiCallListener | None = None, chat_tools: ChatTools | None = None,
                 max_stored_responses: int = 1024) -> None:
        self.state = state
        self.chat_tools = chat_tools or ChatTools()
        self.responses = ResponsesApi(self, max_stored_responses)
        self.embeddings = EmbeddingsApi(self)
        self.scores = ScoreApi(self)
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
            if first.get("type") == "json_invalid":  # its loc is a character offset, not a field
                error = first.get("ctx", {}).get("error", "")
                return JSONResponse(error_body(f"the body is not valid JSON ({error} at character "
                                               f"{first['loc'][-1]})"), status_code=400)
            param = field_path(first.get("loc", ()))
            message = f"{param}: {first.get('msg', 'invalid body')}" if param else first.get("msg", "invalid body")
            return JSONResponse(error_body(message, param=param), status_code=400)

        @app.exception_handler(HTTPException)
        async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
            # FastAPI's own refusals (a body it cannot parse, an unknown route or method) in
            # OpenAI's shape, not {"detail": ...}; a body's problem is the whole body's (no param).
            message, cause = str(exc.detail), exc.__cause__
            if isinstance(cause, UnicodeDecodeError):
                message = f"the body is not valid UTF-8 (byte {cause.object[cause.start]:#04x} at {cause.start})"
            elif isinstance(cause, RecursionError):
                message = "the body's JSON is nested too deeply"
            elif isinstance(cause, ValueError):
                message = f"the body is not valid JSON ({cause})"
            kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
            code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
            return JSONResponse(error_body(message, kind, code=code), status_code=exc.status_code,
                                headers=getattr(exc, "headers", None))

        @app.exception_handler(Exception)
        async def server_error(_: Request, exc: Exception) -> JSONResponse:
            logger.exception("unhandled error in an HTTP call")
            return JSONResponse(error_body(f"internal error ({type(exc).__name__})", "server_error"), status_code=500)

        auth = Depends(self._check_token)

        @app.get("/health")
        async def health() -> JSONResponse:
            if self.state.engine is None and not self.state.is_draining:
                # what the start waits for: the gRPC health protocol has no field to say it
                return JSONResponse({"status": "loading", "phase": self.state.loading_phase}, status_code=503)
            try:
                self.state.ready_engine()
            except EngineUnavailableError as exc:
                return JSONResponse({"status": str(exc)}, status_code=503)
            return JSONResponse({"status": "ok"})

        @app.get("/v1/models", dependencies=[auth])
        async def models() -> dict[str, Any]:
            engine = self._loaded()
            info = engine.model_info()
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": now(),
                                                "owned_by": "minivllm", "max_model_len": info.max_model_len}]}

        @app.post("/v1/completions", dependencies=[auth])
        async def completions(body: CompletionRequest, request: Request) -> Any:
            return await self._serve(body, request, "text_completion", "/v1/completions")

        @app.post("/v1/chat/completions", dependencies=[auth])
        async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
            return await self._serve(body, request, "chat", "/v1/chat/completions")

        @app.post("/v1/embeddings", dependencies=[auth])
        async def embeddings(body: EmbeddingRequest, request: Request) -> Any:
            return await self.embeddings.create(body, request)

        for route in ("/rerank", "/v1/rerank", "/v2/rerank"):
            app.post(route, dependencies=[auth])(self._rerank_route(route))
        for route in ("/score", "/v1/score"):
            app.post(route, dependencies=[auth])(self._score_route(route))

        @app.post("/v1/responses", dependencies=[auth])
        async def responses(body: ResponsesRequest, request: Request) -> Any:
            try:
                return await self.responses.create(body, request)
            except (ValueError, EngineDeadError, EngineUnavailableError) as exc:
                raise _admission_error(exc) from exc

        @app.get("/v1/responses/{response_id}", dependencies=[auth])
        async def get_response(response_id: str) -> JSONResponse:
            return self.responses.retrieve(response_id)

        @app.delete("/v1/responses/{response_id}", dependencies=[auth])
        async def delete_response(response_id: str) -> JSONResponse:
            return self.responses.delete(response_id)

        @app.post("/tokenize", dependencies=[auth])
        async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
            self._check_model(body.model)
            engine = self._loaded()
            try:
                check_text(body)
                messages = body.chat()
                if messages is not None:
                    check_template_kwargs(body.chat_template_kwargs)
                    ids = await self.chat_tools.prompt_ids(engine, messages, body.tool_request(),
                                                           body.chat_template_kwargs)
                else:
                    ids = await engine.tokenize(prompt=body.prompt, add_special_tokens=body.add_special_tokens)
            except ValueError as exc:  # LimitExceededError included
                raise _admission_error(exc) from exc
            out: dict[str, Any] = {"count": len(ids), "max_model_len": engine.model_info().max_model_len,
                                   "tokens": ids}
            if body.return_token_strs:
                out["token_strs"] = await engine.vocabulary_strings(ids)
            return out

        @app.get("/tokenizer_info", dependencies=[auth])
        async def tokenizer_info() -> dict[str, Any]:
            return self._loaded().tokenizer_info()

        @app.post("/detokenize", dependencies=[auth])
        async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
            self._check_model(body.model)
            engine = self._loaded()
            try:
                return {"prompt": await engine.detokenize(body.tokens)}
            except ValueError as exc:
                raise _admission_error(exc) from exc

        return app

    def _rerank_route(self, route: str) -> Any:
        async def rerank(body: RerankRequest, request: Request) -> Any:
            return await self.scores.create(body, request, route)

        return rerank

    def _score_route(self, route: str) -> Any:
        async def score(body: ScoreRequest, request: Request) -> Any:
            return await self.scores.create(body, request, route)

        return score

    def _check_model(self, model: str | None) -> None:
        if model not in (None, "", self.model_name):
            raise ApiError(404, f"model: {model!r} is not served here (this server serves {self.model_name!r})",
                           param="model", code="model_not_found")

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

    @staticmethod
    async def _generate_all(engine: AsyncEngine, request_id: str, params: SamplingParams,
                            prompts: list[str | list[int]]) -> AsyncGenerator[RequestOutput, None] | MergedOutputs:
        """One engine request per prompt, their outputs as one stream (choices numbered across
        them). A prompt refused at admission ends the ones admitted before it."""
        if len(prompts) == 1:
            return await engine.generate(request_id, params, prompt=prompts[0], engine_id=request_id)
        streams: list[AsyncGenerator[RequestOutput, None]] = []
        try:
            for i, prompt in enumerate(prompts):
                streams.append(await engine.generate(f"{request_id}-{i}", params, prompt=prompt,
                                                     engine_id=f"{request_id}-{i}"))
        except BaseException:
            for stream in streams:
                await stream.aclose()
            raise
        return MergedOutputs(streams, params.n)

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
            self._check_model(body.model)
            check_text(body)
            if params_error is not None:
                raise params_error
            engine = self.state.ready_engine(task="generate")
            plan = None
            if is_chat:
                plan, params = await self.chat_tools.prepare(engine, body.chat_messages(), body.tool_request(),
                                                             params, body.chat_template_kwargs)
                stream = await self.chat_tools.generate(engine, request_id, params, plan)
            else:
                stream = await self._generate_all(engine, request_id, params, body.prompt_inputs())
        except ApiError as exc:
            self.observer.finish(handle, None, str(exc.status), exc.message, {"http.response.status_code": exc.status})
            raise
        except (ValueError, EngineDeadError, EngineUnavailableError) as exc:
            # The engine and the chat planning name fields their way; the client hears its own names.
            error = _admission_error(exc.renamed(engine_field_names(body, is_chat)) if isinstance(exc, FieldError)
                                     else exc)
            self.observer.finish(handle, None, str(error.status), error.message,
                                 {"http.response.status_code": error.status})
            raise error from exc
        call = OpenAICall(self.model_name, self.observer, engine, stream, body, params, request_id, handle, plan)
        if body.stream:
            return AbortingStreamingResponse(call.events(), media_type="text/event-stream",
                                              headers={"cache-control": "no-cache", "x-request-id": request_id})
        return await call.whole(request)

