"""OpenTelemetry traces: a SERVER span per request and a span per engine step.

The request span takes its parent from the caller's `traceparent` metadata and carries
gen_ai.* attributes; its queue / prefill / decode phases become child spans and events,
timed from the engine's RequestMetrics. Step spans link to the requests they served.
Export is configured by the standard OTEL_* variables and is off unless an OTLP endpoint
(or OTEL_TRACES_EXPORTER=otlp) is set.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from engine import RequestMetrics, SamplingParams, StepStats
from service.pb import inference_pb2 as pb
from service.servicer import RequestObserver

_MONO_TO_EPOCH_NS = time.time_ns() - time.monotonic_ns()


def epoch_ns(monotonic_s: float) -> int:
    return int(monotonic_s * 1e9) + _MONO_TO_EPOCH_NS


def tracing_enabled_by_env() -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or os.environ.get("OTEL_TRACES_EXPORTER", "").lower() == "otlp")


def make_provider(exporter: SpanExporter | None = None, batch: bool = True) -> TracerProvider:
    """A provider with OTLP export (endpoint and headers from OTEL_* variables) or the given exporter."""
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "minivllm")})
    provider = TracerProvider(resource=resource)
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
    return provider


@dataclass(slots=True)
class _RequestSpan:
    span: trace.Span
    request_id: str


class Tracing(RequestObserver):
    def __init__(self, provider: TracerProvider, model_name: str) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("minivllm")
        self.model_name = model_name
        self._live: dict[str, trace.SpanContext] = {}  # request id -> span, for step-span links
        self._lock = threading.Lock()

    # ---- requests (asyncio thread) ---------------------------------------------------

    def start(self, request_id: str, engine_id: str, request: pb.GenerateRequest, params: SamplingParams | None,
              context: grpc.aio.ServicerContext) -> _RequestSpan:
        carrier = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        parent = propagate.extract(carrier)
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": "chat" if request.WhichOneof("input") == "messages" else "text_completion",
            "gen_ai.system": "minivllm",
            "gen_ai.request.model": self.model_name,
            "gen_ai.request.id": request_id,
            "rpc.system": "grpc", "rpc.service": "minivllm.v1.Inference", "rpc.method": "Generate",
        }
        if params is not None:  # the values the engine really uses, defaults applied
            attrs |= {"gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p}
            if params.max_tokens is not None:
                attrs["gen_ai.request.max_tokens"] = params.max_tokens
            if params.seed is not None:
                attrs["gen_ai.request.seed"] = params.seed
        span = self.tracer.start_span(f"{attrs['gen_ai.operation.name']} {self.model_name}", context=parent,
                                      kind=SpanKind.SERVER, attributes=attrs)
        with self._lock:
            self._live[engine_id] = span.get_span_context()  # step stats name requests by engine id
        return _RequestSpan(span, engine_id)

    def finish(self, handle: _RequestSpan | None, final: Any, status: grpc.StatusCode, message: str = "") -> None:
        if handle is None:
            return
        with self._lock:
            self._live.pop(handle.request_id, None)
        span = handle.span
        span.set_attribute("rpc.grpc.status_code", status.value[0])
        metrics: RequestMetrics | None = getattr(final, "metrics", None)
        if metrics is not None:
            self._add_phases(span, metrics)
        if status is grpc.StatusCode.OK:
            span.set_status(Status(StatusCode.OK))
        else:
            span.set_status(Status(StatusCode.ERROR, f"{status.name}: {message}"))
        span.end()

    def _add_phases(self, span: trace.Span, m: RequestMetrics) -> None:
        span.set_attributes({
            "gen_ai.usage.input_tokens": m.num_prompt_tokens, "gen_ai.usage.output_tokens": m.num_output_tokens,
            "gen_ai.usage.prompt_tokens": m.num_prompt_tokens, "gen_ai.usage.completion_tokens": m.num_output_tokens,
            "gen_ai.usage.cached_tokens": m.num_cached_tokens,
            "gen_ai.response.finish_reasons": [m.finish_reason],
            "gen_ai.latency.e2e": m.e2e_latency, "minivllm.num_preemptions": m.num_preemptions,
        })
        for key, value in (("gen_ai.latency.time_to_first_token", m.time_to_first_token),
                           ("gen_ai.latency.time_in_queue", m.queue_time),
                           ("gen_ai.latency.time_in_model_prefill", m.prefill_time),
                           ("gen_ai.latency.time_in_model_decode", m.decode_time),
                           ("gen_ai.latency.time_per_output_token", m.time_per_output_token)):
            if value is not None:
                span.set_attribute(key, value)
        span.add_event("queued", timestamp=epoch_ns(m.arrival_time))
        if m.first_scheduled_time is not None:
            span.add_event("scheduled", timestamp=epoch_ns(m.first_scheduled_time))
        if m.first_token_time is not None:
            span.add_event("first_token", timestamp=epoch_ns(m.first_token_time))
        span.add_event("finished", {"finish_reason": m.finish_reason}, timestamp=epoch_ns(m.finished_time))
        ctx = trace.set_span_in_context(span)
        phases = (("queue", m.arrival_time, m.first_scheduled_time),
                  ("prefill", m.first_scheduled_time, m.first_token_time),
                  ("decode", m.first_token_time, m.finished_time))
        for name, start, end in phases:
            if start is not None and end is not None:
                child = self.tracer.start_span(name, context=ctx, start_time=epoch_ns(start))
                child.end(end_time=epoch_ns(end))

    # ---- steps (engine thread) ---------------------------------------------------------

    def on_step(self, stats: StepStats) -> None:
        if not stats.num_prefill_tokens and not stats.num_decode_tokens:
            return
        with self._lock:
            links = [Link(self._live[r]) for r in stats.prefill_request_ids + stats.decode_request_ids
                     if r in self._live]
        span = self.tracer.start_span("engine.step", kind=SpanKind.INTERNAL, links=links,
                                      start_time=epoch_ns(stats.start_time), attributes={
                                          "minivllm.step.id": stats.step_id,
                                          "minivllm.step.prefill_tokens": stats.num_prefill_tokens,
                                          "minivllm.step.decode_tokens": stats.num_decode_tokens,
                                          "minivllm.step.batch_size": stats.num_prefill_seqs + stats.num_decode_seqs,
                                          "minivllm.step.num_prefill_seqs": stats.num_prefill_seqs,
                                          "minivllm.step.num_decode_seqs": stats.num_decode_seqs,
                                          "minivllm.step.preemptions": stats.num_preemptions,
                                          "minivllm.step.kind": stats.kind,
                                          "minivllm.step.forward_time": stats.forward_time,
                                      })
        span.end(end_time=epoch_ns(stats.start_time + stats.total_time))

    def shutdown(self) -> None:
        self.provider.shutdown()
