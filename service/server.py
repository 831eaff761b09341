"""The server: gRPC (health, reflection, keepalive and size limits) and the OpenAI-compatible
HTTP front door on one event loop and one engine, with one graceful SIGTERM drain for both."""
from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from engine import EngineConfig, LLMEngine, ModelInfo, model_display_name
from service.async_engine import AsyncEngine, StatsListener
from service.chat.tools import ChatTools
from service.grpc.kv_event_hub import KvEventHub
from service.grpc.minivllm_servicer import InferenceServicer
from service.grpc.security import TokenAuthInterceptor, server_credentials
from service.grpc.vllm_servicer import VLLM_SERVICE_NAME, ModelFiles, VllmEngineServicer
from service.observability.request_observer import RequestObserver
from service.openai.api import ApiCallListener, OpenAIFrontDoor
from service.openai.http_server import HttpServer
from service.pb import inference_pb2 as pb
from service.pb import inference_pb2_grpc as pb_grpc
from service.serving_state import ServingState

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
# The gRPC services one server can run: our own, and vLLM's engine contract (for gateways).
GRPC_SERVICES = {"minivllm": SERVICE_NAME, "vllm": VLLM_SERVICE_NAME}


@dataclass(slots=True)
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 50051
    drain_grace_s: float = 30.0
    max_message_bytes: int = 4 * 1024 * 1024  # larger requests are refused by gRPC (RESOURCE_EXHAUSTED)
    max_concurrent_rpcs: int | None = 1024  # beyond it gRPC refuses new calls (RESOURCE_EXHAUSTED)
    tls_cert_file: str | None = None  # with tls_key_file: serve TLS only
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None  # mutual TLS: clients need a certificate this CA signed
    auth_tokens: list[str] = field(default_factory=list)  # non-empty: bearer tokens required (health stays open)
    http_host: str = "0.0.0.0"
    http_port: int | None = None  # OpenAI-compatible HTTP; None: off, 0: a free port
    served_model_name: str | None = None  # the name clients see (OpenAI `model`); None: the model's own
    tool_call_parser: str = "auto"  # a tool-call format's name, or auto: the chat template's (service/chat/tool_parsers)
    # deepseek_r1 | qwen3: thinking goes to reasoning_content; auto: the chat template's (service/chat/
    # template_traits); None or "none": off
    reasoning_parser: str | None = "auto"
    max_stored_responses: int = 1024  # /v1/responses kept for previous_response_id
    grpc_services: tuple[str, ...] = ("minivllm", "vllm")  # keys of GRPC_SERVICES, served on the one port
    engine: EngineConfig = field(default_factory=EngineConfig)


class InferenceServer:
    """Owns the grpc.aio server, the health state and the engine's lifetime."""

    def __init__(self, config: ServerConfig, stats_listeners: list[StatsListener] | None = None,
                 observer: RequestObserver | None = None,
                 interceptors: list[grpc.aio.ServerInterceptor] | None = None,
                 on_http_call: ApiCallListener | None = None) -> None:
        self.config = config
        unknown = set(config.grpc_services) - set(GRPC_SERVICES)
        if unknown or not config.grpc_services:
            raise ValueError(f"grpc_services: expected some of {', '.join(GRPC_SERVICES)}, got "
                             f"{', '.join(config.grpc_services) or 'none'}")
        self.service_names = tuple(GRPC_SERVICES[name] for name in config.grpc_services)
        self.stats_listeners = list(stats_listeners or [])
        self.state = ServingState()
        self.chat_tools = ChatTools(config.tool_call_parser, config.reasoning_parser)
        self.servicer = InferenceServicer(self.state, observer, self.chat_tools)
        self.kv_events = KvEventHub(max_running_requests=config.engine.max_num_seqs)
        self.vllm_servicer = VllmEngineServicer(self.state, self.kv_events, observer)
        if "vllm" in config.grpc_services:
            self.stats_listeners.append(self.kv_events.on_step)
        self.health = health.aio.HealthServicer()
        self.exit_code = 0  # non-zero once the engine died: the process should exit so a supervisor restarts it
        interceptors = list(interceptors or [])
        if config.auth_tokens:
            interceptors.insert(0, TokenAuthInterceptor(config.auth_tokens))
        self.server = grpc.aio.server(interceptors=interceptors, maximum_concurrent_rpcs=config.max_concurrent_rpcs,
                                      options=[
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
        ])
        if "minivllm" in config.grpc_services:
            pb_grpc.add_InferenceServicer_to_server(self.servicer, self.server)
        if "vllm" in config.grpc_services:
            vpb_grpc.add_VllmEngineServicer_to_server(self.vllm_servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection((*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME),
                                            self.server)
        address = f"{config.host}:{config.port}"
        if (config.tls_cert_file is None) != (config.tls_key_file is None):
            raise ValueError("tls: give both a certificate and a key file")
        if config.tls_cert_file is not None:
            creds = server_credentials(config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file)
            self.port = self.server.add_secure_port(address, creds)
        else:
            if config.tls_client_ca_file is not None:
                raise ValueError("tls: a client CA needs a server certificate and key")
            self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot listen on {config.host}:{config.port}")
        self.http: HttpServer | None = None
        if config.http_port is not None:
            door = OpenAIFrontDoor(self.state, config.served_model_name or model_display_name(config.engine.model),
                                   observer, config.auth_tokens, config.max_message_bytes, on_http_call,
                                   self.chat_tools, config.max_stored_responses)
            self.http = HttpServer(door.asgi, config.http_host, config.http_port)
        self.async_engine: AsyncEngine | None = None
        self._stopped = asyncio.Event()

    async def _set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def start(self, engine_factory: Callable[[], LLMEngine] | None = None) -> None:
        """Listen at once (NOT_SERVING), load the model off the loop, then go SERVING."""
        await self._set_serving(False)
        await self.server.start()
        logger.info("gRPC listening on %s:%d (health NOT_SERVING while the model loads)", self.config.host, self.port)
        if self.http is not None:
            await self.http.start()
            logger.info("HTTP (OpenAI-compatible) listening on %s:%d", self.config.http_host, self.http.port)
        # The engine reports each start-up phase as it begins: /health and UNAVAILABLE's details say it.
        factory = engine_factory or (lambda: LLMEngine(self.config.engine, on_phase=self.state.set_loading_phase))
        self.kv_events.bind(asyncio.get_running_loop())
        # The engine thread loads the model (off the loop) and then runs it: see AsyncEngine.
        # Only the vLLM contract's SubscribeKvEvents streams read the prefix-cache events: without
        # it the engine records none.
        async_engine = AsyncEngine(factory, self.stats_listeners, on_death=self._on_engine_death,
                                   kv_event_listeners=[self.kv_events.on_kv_events]
                                   if "vllm" in self.config.grpc_services else [])
        await async_engine.start()
        self.vllm_servicer.files = self._model_files(async_engine.model_info())
        self.async_engine = async_engine
        self.state.set_engine(async_engine)
        await self._set_serving(True)
        logger.info("model %s loaded; serving on %s:%d", async_engine.model_info().model_name, self.config.host, self.port)

    def _model_files(self, info: ModelInfo) -> ModelFiles:
        engine = self.config.engine
        # where the engine resolved the model: the service never resolves one itself
        return ModelFiles(engine.model or model_display_name(engine.model), Path(info.model_dir),
                          Path(info.tokenizer_dir), self.config.served_model_name or model_display_name(engine.model))

    async def drain_and_stop(self) -> None:
        """Graceful shutdown: NOT_SERVING, refuse new calls, let running streams finish."""
        if self.state.is_draining:
            return
        logger.info("draining: refusing new requests, finishing running ones (grace %.0f s)", self.config.drain_grace_s)
        self.state.is_draining = True
        await self.health.enter_graceful_shutdown()
        if self.async_engine is not None:
            drained = await self.async_engine.wait_idle(self.config.drain_grace_s)
            if not drained:
                logger.warning("grace period over with requests still running; aborting them")
        await self.server.stop(grace=1.0)
        if self.http is not None:
            await self.http.stop()
        if self.async_engine is not None:
            self.async_engine.stop()
        self._stopped.set()
        logger.info("server stopped")

    def _on_engine_death(self) -> None:
        logger.critical("the engine thread died: NOT_SERVING, failing every call, exiting")
        self.exit_code = 1
        self.state.is_draining = True
        asyncio.ensure_future(self._stop_after_death())

    async def _stop_after_death(self) -> None:
        await self._set_serving(False)
        await self.server.stop(grace=1.0)
        if self.http is not None:
            await self.http.stop()
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self.drain_and_stop()))
