"""OpenTelemetry traces: a SERVER span per request and, opt-in, a span per engine step.

The request span takes its parent from the caller's `traceparent` (gRPC metadata or HTTP
header) and follows the GenAI semantic conventions (gen_ai.provider.name, gen_ai.request.*,
gen_ai.response.id / finish_reasons, gen_ai.usage.*, error.type); its queue / prefill / decode
phases become child spans and events, timed from the engine's RequestMetrics. Step spans
(MINIVLLM_TRACE_STEPS=true) link to the requests they served.

Export is configured by the standard OTEL_* variables and is off unless an OTLP endpoint (or
OTEL_TRACES_EXPORTER=otlp) is set; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (or
OTEL_EXPORTER_OTLP_PROTOCOL) picks grpc or http/protobuf (the specification's default).
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from engine import RequestMetrics, SamplingParams, StepStats
from service.observability.request_observer import CallInfo, RequestObserver

PROTOCOLS = ("grpc", "http/protobuf")
# CallInfo.protocol of the gRPC doors -> the service they serve.
RPC_SERVICES = {"grpc": "minivllm.v1.Inference", "grpc-vllm": "vllm.grpc.engine.VllmEngine"}

_MONO_TO_EPOCH_NS = time.time_ns() - time.monotonic_ns()


def epoch_ns(monotonic_s: float) -> int:
    return int(monotonic_s * 1e9) + _MONO_TO_EPOCH_NS


def tracing_enabled_by_env() -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or os.environ.get("OTEL_TRACES_EXPORTER", "").lower() == "otlp")


def step_spans_enabled_by_env() -> bool:
    return os.environ.get("MINIVLLM_TRACE_STEPS", "").lower() in ("1", "true", "yes", "on")


def otlp_protocol() -> str:
    """The OTLP transport the standard variables ask for (traces-specific one first)."""
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf").strip().lower()
    if protocol not in PROTOCOLS:
        raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: expected one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    return protocol


def make_otlp_exporter() -> SpanExporter:
    """An OTLP span exporter for the protocol the OTEL_* variables name (endpoint, headers and
    TLS settings are read by the exporter itself from the same variables)."""
    if otlp_protocol() == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter()


def make_provider(exporter: SpanExporter | None = None, batch: bool = True) -> TracerProvider:
    """A provider with OTLP export (from OTEL_* variables) or the given exporter."""
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "minivllm")})
    provider = TracerProvider(resource=resource)
    if exporter is None:
        exporter = make_otlp_exporter()
    provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
    return provider


@dataclass(slots=True)
class _RequestSpan:
    span: trace.Span
    request_id: str


class Tracing(RequestObserver):
    def __init__(self, provider: TracerProvider, model_name: str, trace_steps: bool = False) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("minivllm")
        self.model_name = model_name
        self.trace_steps = trace_steps
        self._live: dict[str, trace.SpanContext] = {}  # request id -> span, for step-span links
        self._lock = threading.Lock()

    # ---- requests (asyncio thread) ---------------------------------------------------

    def start(self, request_id: str, engine_id: str, call: CallInfo, params: SamplingParams | None
              ) -> _RequestSpan:
        parent = propagate.extract(dict(call.carrier))
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": call.operation,
            "gen_ai.provider.name": "minivllm",
            "gen_ai.request.model": self.model_name,
            "gen_ai.response.model": self.model_name,
            "gen_ai.response.id": request_id,
        }
        if call.protocol in RPC_SERVICES:
            attrs |= {"rpc.system": "grpc", "rpc.service": RPC_SERVICES[call.protocol], "rpc.method": call.method}
        else:
            attrs |= {"http.request.method": "POST", "http.route": call.method}
        if call.num_choices != 1:
            attrs["gen_ai.request.choice.count"] = call.num_choices
        if params is not None:  # the values the engine really uses, defaults applied
            attrs |= {"gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
                      "gen_ai.request.presence_penalty": params.presence_penalty,
                      "gen_ai.request.frequency_penalty": params.frequency_penalty}
            if params.top_k:
                attrs["gen_ai.request.top_k"] = params.top_k
            if params.max_tokens is not None:
                attrs["gen_ai.request.max_tokens"] = params.max_tokens
            if params.seed is not None:
                attrs["gen_ai.request.seed"] = params.seed
            if params.stop:
                attrs["gen_ai.request.stop_sequences"] = list(params.stop)
        span = self.tracer.start_span(f"{call.operation} {self.model_name}", context=parent, kind=SpanKind.SERVER,
                                      attributes=attrs)
        with self._lock:
            self._live[engine_id] = span.get_span_context()  # step stats name requests by engine id
        return _RequestSpan(span, engine_id)

    def finish(self, handle: _RequestSpan | None, final: Any, error_type: str | None, message: str = "",
               attributes: Mapping[str, Any] | None = None) -> None:
        if handle is None:
            return
        with self._lock:
            self._live.pop(handle.request_id, None)
        span = handle.span
        if attributes:
            span.set_attributes(dict(attributes))
        metrics: RequestMetrics | None = getattr(final, "metrics", None)
        if metrics is not None:
            self._add_phases(span, metrics)
        if error_type is None:
            span.set_status(Status(StatusCode.OK))
        else:
            span.set_attribute("error.type", error_type)
            span.set_status(Status(StatusCode.ERROR, f"{error_type}: {message}"))
        span.end()

    def _add_phases(self, span: trace.Span, m: RequestMetrics) -> None:
        span.set_attributes({
            "gen_ai.usage.input_tokens": m.num_prompt_tokens, "gen_ai.usage.output_tokens": m.num_output_tokens,
            "gen_ai.usage.cache_read.input_tokens": m.num_cached_tokens,
            "gen_ai.response.finish_reasons": [m.finish_reason],
            "minivllm.latency.e2e": m.e2e_latency, "minivllm.num_preemptions": m.num_preemptions,
        })
        if m.num_draft_tokens:  # speculative decoding: what it proposed and what was accepted
            span.set_attributes({"minivllm.spec_decode.draft_tokens": m.num_draft_tokens,
                                 "minivllm.spec_decode.accepted_tokens": m.num_accepted_tokens})
        # No GenAI convention names server-side latency phases yet: these are minivllm's own.
        for key, value in (("minivllm.latency.time_to_first_token", m.time_to_first_token),
                           ("minivllm.latency.time_in_queue", m.queue_time),
                           ("minivllm.latency.time_in_model_prefill", m.prefill_time),
                           ("minivllm.latency.time_in_model_decode", m.decode_time),
                           ("minivllm.latency.time_per_output_token", m.time_per_output_token)):
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
        if not self.trace_steps or (not stats.num_prefill_tokens and not stats.num_decode_tokens):
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
