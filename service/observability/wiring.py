"""Wires metrics and tracing into the server: step listener, request observer, interceptor."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc

from engine import StepStats
from service.observability.metrics import ServiceMetrics
from service.observability.request_observer import RequestObserver
from service.observability.tracing import Tracing, make_provider, step_spans_enabled_by_env, tracing_enabled_by_env

logger = logging.getLogger(__name__)


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts every unary and server-streaming call by method and final status code (a stream the
    client cancelled is CANCELLED however it ends inside the server)."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self.metrics = metrics

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        service, _, method = details.method.lstrip("/").rpartition("/")
        # vLLM's engine contract has its own protocol label: a gateway's calls, apart from clients'.
        protocol = "grpc-vllm" if service == "vllm.grpc.engine.VllmEngine" else "grpc"
        observed = functools.partial(self._observed, protocol)
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request: Any, context: Any) -> Any:
                with observed(method, context):
                    return await inner(request, context)

            return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer,
                                                       handler.response_serializer)
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
                with observed(method, context):
                    result = inner_stream(request, context)
                    if hasattr(result, "__aiter__"):  # an async generator handler
                        # aclosing: a call that ends at a yield closes the handler's generator now.
                        async with contextlib.aclosing(result):
                            async for item in result:
                                yield item
                    else:  # a coroutine that writes with context.write (grpc.health.v1 Watch)
                        await result

            return grpc.unary_stream_rpc_method_handler(stream, handler.request_deserializer,
                                                        handler.response_serializer)
        return handler

    @contextlib.contextmanager
    def _observed(self, protocol: str, method: str, context: Any) -> Iterator[None]:
        """Time one call and record it with its final status code."""
        start, code = time.monotonic(), grpc.StatusCode.OK
        try:
            yield
        except (asyncio.CancelledError, GeneratorExit):
            # The client went away: grpc cancels the handler's task or, when a stream waits at a
            # yield, closes its generator (GeneratorExit); which one is a race, the code is the same.
            code = grpc.StatusCode.CANCELLED
            raise
        except BaseException:
            code = grpc.StatusCode.UNKNOWN
            raise
        finally:
            set_code = context.code()  # set by context.abort / set_code
            final = set_code if isinstance(set_code, grpc.StatusCode) else code
            self.metrics.on_api_call(protocol, method, final.name, time.monotonic() - start)


class Observability:
    def __init__(self, metrics: ServiceMetrics, tracing: Tracing | None = None) -> None:
        self.metrics = metrics
        self.tracing = tracing

    @classmethod
    def from_env(cls, model_name: str, metrics_port: int = 9400, metrics_host: str = "0.0.0.0") -> Observability:
        metrics = ServiceMetrics(model_name)
        if metrics_port:
            metrics.serve(metrics_port, metrics_host)
            logger.info("Prometheus metrics on http://%s:%d/metrics", metrics_host, metrics_port)
        tracing = None
        if tracing_enabled_by_env():
            tracing = Tracing(make_provider(), model_name, trace_steps=step_spans_enabled_by_env())
            logger.info("OpenTelemetry tracing on (OTLP exporter from OTEL_* variables; step spans %s)",
                        "on" if tracing.trace_steps else "off")
        return cls(metrics, tracing)

    @property
    def request_observer(self) -> RequestObserver | None:
        return self.tracing

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [MetricsInterceptor(self.metrics)]

    def on_step(self, stats: StepStats) -> None:
        self.metrics.on_step(stats)
        if self.tracing is not None:
            self.tracing.on_step(stats)

    def shutdown(self) -> None:
        if self.tracing is not None:
            self.tracing.shutdown()
