"""A test double of AsyncEngine whose every request answers with scripted token ids, one output
per token (a stream the parsers read as they would a model's), served by the real OpenAI front
door over HTTP and the real minivllm gRPC servicer. Stop conditions are not applied: the script
is the whole answer (max_tokens cuts it, as length). It records what each request was admitted with (prompt ids, sampling
parameters), so a test checks what the service sent the engine as well as what came back.

For output formats no small real model writes on cue (gpt-oss's Harmony: a tiny random model's
tokens are noise in an o200k vocabulary); the engine's own paths are tested with real models."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from engine import ModelInfo, RequestOutput, SamplingParams
from service.chat.tools import ChatTools
from service.grpc.minivllm_servicer import InferenceServicer
from service.openai.api import OpenAIFrontDoor
from service.openai.http_server import HttpServer
from service.pb import inference_pb2_grpc as pb_grpc
from service.serving_state import ServingState


@dataclass(slots=True)
class Admitted:
    request_id: str
    params: SamplingParams
    prompt: str | list[int] | None
    messages: list[dict[str, Any]] | None


@dataclass
class ScriptedEngine:
    """answer: the token ids every request gets; decode: their text (RequestOutput.new_text)."""

    model_dir: Path
    answer: list[int]
    decode: Callable[[list[int]], str]
    chat_template: str | None = None
    admitted: list[Admitted] = field(default_factory=list)
    is_dead: bool = False

    def model_info(self) -> ModelInfo:
        return ModelInfo("scripted", 4096, 201_088, 8, 4096, 64, 16, 256, "cpu", "float32", (200_002,),
                         self.chat_template is not None, "auto", str(self.model_dir), str(self.model_dir))

    def tokenizer_info(self) -> dict[str, Any]:
        return {"chat_template": self.chat_template}

    def stop_sample(self, engine_id: str, index: int) -> None:
        pass

    def new_engine_id(self, request_id: str) -> str:
        return f"{request_id}#{len(self.admitted)}"

    async def generate(self, request_id: str, params: SamplingParams, prompt: str | list[int] | None = None,
                       messages: list[dict[str, Any]] | None = None, priority: int = 0,
                       engine_id: str | None = None,
                       chat_template_kwargs: dict[str, Any] | None = None) -> AsyncGenerator[RequestOutput, None]:
        self.admitted.append(Admitted(request_id, params, prompt, messages))
        prompt_ids = list(prompt) if isinstance(prompt, list) else [0]
        answer = self.answer[:params.max_tokens] if params.max_tokens is not None else self.answer

        async def outputs() -> AsyncGenerator[RequestOutput, None]:
            for i, token in enumerate(answer):
                await asyncio.sleep(0)
                is_last = i == len(answer) - 1
                reason = None if not is_last else "length" if len(answer) < len(self.answer) else "stop"
                yield RequestOutput(engine_id or request_id, prompt_ids, answer[:i + 1], self.decode(answer[:i + 1]),
                                    [token], self.decode([token]), finish_reason=reason)

        return outputs()


class ScriptedServer:
    """The OpenAI front door and the gRPC servicer on a ScriptedEngine, on their own event loop thread."""

    def __init__(self, engine: ScriptedEngine, chat_tools: ChatTools | None = None) -> None:
        self.engine = engine
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="scripted-server", daemon=True)
        self._thread.start()
        self.http, self.grpc_port = asyncio.run_coroutine_threadsafe(self._start(chat_tools), self._loop).result(30)

    async def _start(self, chat_tools: ChatTools | None) -> tuple[HttpServer, int]:
        state = ServingState()
        state.set_engine(self.engine)  # type: ignore[arg-type]  # the AsyncEngine surface the front doors use
        tools = chat_tools or ChatTools()
        door = OpenAIFrontDoor(state, "gpt-oss-scripted", chat_tools=tools)
        http = HttpServer(door.asgi, "127.0.0.1", 0)
        await http.start()
        self._grpc = grpc.aio.server()
        pb_grpc.add_InferenceServicer_to_server(InferenceServicer(state, chat_tools=tools), self._grpc)
        port = self._grpc.add_insecure_port("127.0.0.1:0")
        await self._grpc.start()
        return http, port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http.port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.http.stop(), self._loop).result(30)
        asyncio.run_coroutine_threadsafe(self._grpc.stop(None), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
