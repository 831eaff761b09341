"""Prometheus metrics, built from the engine's StepStats and RequestMetrics values.

Names follow Prometheus conventions: a minivllm_ prefix, base units (seconds, tokens,
ratios), _total on counters, and a model_name label. Latency buckets start at 1 ms and are
fine enough for a CPU model, whose steps take tens to hundreds of milliseconds.
"""
from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)

from engine import RequestMetrics, StepStats

# Up to 40 minutes: a CPU serving long outputs to a crowd can take many minutes per request.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                   1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0, 2400.0)
TOKEN_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
EXPERT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512)
RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
POOLING_TASKS = ("embed", "score")  # the pooling requests' tasks (RequestMetrics.task): prefill only


class ServiceMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        reg, label = self.registry, ["model_name"]
        ProcessCollector(registry=reg)
        PlatformCollector(registry=reg)

        def hist(name: str, doc: str, buckets: tuple, extra: list[str] | None = None) -> Histogram:
            return Histogram(name, doc, label + (extra or []), buckets=buckets, registry=reg)

        self.requests_waiting = Gauge("minivllm_requests_waiting", "Requests waiting to be scheduled", label, registry=reg)
        self.requests_running = Gauge("minivllm_requests_running", "Requests in the running batch", label, registry=reg)
        self.kv_cache_usage = Gauge("minivllm_kv_cache_usage_ratio", "Fraction of KV cache blocks in use", label,
                                    registry=reg)
        self.step_prefill_tokens = hist("minivllm_step_prefill_tokens", "Prefill tokens computed in one engine step",
                                        TOKEN_BUCKETS)
        self.step_decode_tokens = hist("minivllm_step_decode_tokens", "Decode tokens computed in one engine step",
                                       TOKEN_BUCKETS)
        self.step_duration = hist("minivllm_step_duration_seconds",
                                  "Engine step time by phase: the forward of prefill-only, decode-only and mixed steps; overhead = schedule, input prep, sampling, output processing",
                                  LATENCY_BUCKETS, ["phase"])
        self.prefill_tokens = Counter("minivllm_prefill_tokens_total", "Tokens run through the prefill path", label,
                                      registry=reg)
        self.decode_tokens = Counter("minivllm_decode_tokens_total", "Tokens run through the decode path", label,
                                     registry=reg)
        self.prompt_tokens = Counter("minivllm_prompt_tokens_total", "Prompt tokens of finished requests", label,
                                     registry=reg)
        self.generation_tokens = Counter("minivllm_generation_tokens_total", "Generated tokens", label, registry=reg)
        self.preemptions = Counter("minivllm_preemptions_total", "Sequences preempted (recompute)", label, registry=reg)
        self.prefix_queries = Counter("minivllm_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache",
                                      label, registry=reg)
        self.prefix_hits = Counter("minivllm_prefix_cache_hits_total", "Prompt tokens served from the prefix cache",
                                   label, registry=reg)
        self.finished = Counter("minivllm_requests_finished_total", "Finished requests by finish reason",
                                label + ["finish_reason"], registry=reg)
        self.ttft = hist("minivllm_time_to_first_token_seconds", "Arrival to first token", LATENCY_BUCKETS)
        self.itl = hist("minivllm_inter_token_latency_seconds", "Gap between consecutive tokens of a request",
                        LATENCY_BUCKETS)
        # Per request (its mean gap), not per token: minivllm_inter_token_latency_seconds is that.
        self.tpot = hist("minivllm_request_time_per_output_token_seconds",
                         "Mean gap between the output tokens of one request (one sample per finished request)",
                         LATENCY_BUCKETS)
        self.queue_time = hist("minivllm_request_queue_time_seconds", "Arrival to first scheduled", LATENCY_BUCKETS)
        self.prefill_time = hist("minivllm_request_prefill_time_seconds", "First scheduled to first token",
                                 LATENCY_BUCKETS)
        self.decode_time = hist("minivllm_request_decode_time_seconds", "First token to finish", LATENCY_BUCKETS)
        self.e2e = hist("minivllm_e2e_request_latency_seconds", "Arrival to finish", LATENCY_BUCKETS)
        self.request_prompt_tokens = hist("minivllm_request_prompt_tokens", "Prompt tokens per request", TOKEN_BUCKETS)
        self.request_generation_tokens = hist("minivllm_request_generation_tokens", "Generated tokens per request",
                                              TOKEN_BUCKETS)
        self.step_time_target = Gauge("minivllm_step_time_target_seconds",
                                      "Step-time target of the last step whose prefill was sized by time", label,
                                      registry=reg)
        self.step_time_predicted = Gauge("minivllm_step_time_predicted_seconds",
                                         "Predicted time of the last step (learned cost model)", label, registry=reg)
        self.step_time_actual = Gauge("minivllm_step_time_actual_seconds", "Measured time of the last predicted step",
                                      label, registry=reg)
        self.step_time_error = hist("minivllm_step_time_prediction_ratio",
                                    "Measured / predicted step time (1 = exact)", RATIO_BUCKETS)
        # Mixture of experts: a step's distinct experts per MoE layer (the mean over its layers,
        # comparable with the model's expert count whatever its depth). A dense model's steps
        # touch no experts: no sample at all, rather than zeros that would read as a MoE model
        # routing nothing (and pass the dashboard's check without a MoE model behind it).
        self.step_experts_touched = hist("minivllm_step_experts_touched_per_layer",
                                         "Distinct experts a step ran per MoE layer (mean over layers)",
                                         EXPERT_BUCKETS)
        self.steps = Counter("minivllm_steps_total", "Engine steps by what sized their prefill (time or tokens)",
                             label + ["budget"], registry=reg)
        self.api_requests = Counter("minivllm_api_requests_total",
                                    "Calls by protocol (grpc | grpc-vllm | http), method (RPC or route) and status code "
                                    "(gRPC code name or HTTP status)", label + ["protocol", "method", "code"],
                                    registry=reg)
        self.api_duration = hist("minivllm_api_request_duration_seconds", "Call duration by protocol and method",
                                 LATENCY_BUCKETS, ["protocol", "method"])
        self.spec_draft_tokens = Counter("minivllm_spec_decode_draft_tokens_total",
                                         "Proposed tokens verified (speculative decoding), by method",
                                         label + ["method"], registry=reg)
        self.spec_accepted_tokens = Counter("minivllm_spec_decode_accepted_tokens_total",
                                            "Proposed tokens accepted (speculative decoding), by method",
                                            label + ["method"], registry=reg)
        self.spec_accepted_length = hist("minivllm_spec_decode_accepted_length",
                                         "Proposed tokens accepted per verification", TOKEN_BUCKETS[:6])
        # Pooling requests (embeddings and scores: prefill only, no output tokens) apart from
        # generation's, so neither's latency and token histograms mix the two kinds of work; by task.
        self.pooling_finished = Counter("minivllm_pooling_requests_finished_total",
                                        "Finished pooling requests by task (embed, score) and finish reason",
                                        label + ["task", "finish_reason"], registry=reg)
        self.pooling_prompt_tokens = Counter("minivllm_pooling_prompt_tokens_total",
                                             "Prompt tokens of finished pooling requests by task", label + ["task"],
                                             registry=reg)
        self.pooling_e2e = hist("minivllm_pooling_request_latency_seconds",
                                "Arrival to finish of a pooling request, by task", LATENCY_BUCKETS, ["task"])
        self.pooling_queue_time = hist("minivllm_pooling_request_queue_time_seconds",
                                       "Arrival to first scheduled of a pooling request, by task", LATENCY_BUCKETS,
                                       ["task"])
        m = model_name
        for reason in FINISH_REASONS:  # every reason is a series from the start, even at zero
            self.finished.labels(m, reason)
            for task in POOLING_TASKS:
                self.pooling_finished.labels(m, task, reason)
        for phase in ("prefill", "decode", "mixed", "overhead"):
            self.step_duration.labels(m, phase)

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve /metrics; returns the bound port (port 0 picks a free one)."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port

    def on_step(self, stats: StepStats) -> None:
        m = self.model_name
        self.requests_waiting.labels(m).set(stats.num_waiting)
        self.requests_running.labels(m).set(stats.num_running)
        self.kv_cache_usage.labels(m).set(stats.kv_cache_usage)
        if stats.num_prefill_tokens or stats.num_decode_tokens:
            self.step_prefill_tokens.labels(m).observe(stats.num_prefill_tokens)
            self.step_decode_tokens.labels(m).observe(stats.num_decode_tokens)
            self.step_duration.labels(m, "overhead").observe(stats.overhead_time)
            self.step_duration.labels(m, stats.kind).observe(stats.forward_time)
            self.steps.labels(m, stats.budget_source).inc()
        if (experts := stats.experts_touched_per_layer) is not None:
            self.step_experts_touched.labels(m).observe(experts)
        if stats.step_time_target is not None:
            self.step_time_target.labels(m).set(stats.step_time_target)
        if stats.predicted_step_time:
            self.step_time_predicted.labels(m).set(stats.predicted_step_time)
            self.step_time_actual.labels(m).set(stats.total_time)
            self.step_time_error.labels(m).observe(stats.total_time / stats.predicted_step_time)
        self.prefill_tokens.labels(m).inc(stats.num_prefill_tokens)
        self.decode_tokens.labels(m).inc(stats.num_decode_tokens)
        self.generation_tokens.labels(m).inc(stats.num_generated_tokens)
        self.preemptions.labels(m).inc(stats.num_preemptions)
        self.prefix_queries.labels(m).inc(stats.num_prefix_queried_tokens)
        self.prefix_hits.labels(m).inc(stats.num_prefix_hit_tokens)
        for value in stats.times_to_first_token:
            self.ttft.labels(m).observe(value)
        itl = self.itl.labels(m)
        for value in stats.inter_token_latencies:
            itl.observe(value)
        if stats.spec_method != "none":  # a series from the start, even at zero
            self.spec_draft_tokens.labels(m, stats.spec_method).inc(stats.num_draft_tokens)
            self.spec_accepted_tokens.labels(m, stats.spec_method).inc(stats.num_accepted_tokens)
            for length in stats.accepted_lengths:
                self.spec_accepted_length.labels(m).observe(length)
        for req in stats.finished:
            self.on_finished(req)

    def on_finished(self, req: RequestMetrics) -> None:
        m = self.model_name
        if req.task in POOLING_TASKS:
            self.pooling_finished.labels(m, req.task, req.finish_reason).inc()
            self.pooling_prompt_tokens.labels(m, req.task).inc(req.num_prompt_tokens)
            self.pooling_e2e.labels(m, req.task).observe(req.e2e_latency)
            if req.queue_time is not None:
                self.pooling_queue_time.labels(m, req.task).observe(req.queue_time)
            return
        self.finished.labels(m, req.finish_reason).inc()
        self.prompt_tokens.labels(m).inc(req.num_prompt_tokens)
        self.request_prompt_tokens.labels(m).observe(req.num_prompt_tokens)
        self.request_generation_tokens.labels(m).observe(req.num_output_tokens)
        self.e2e.labels(m).observe(req.e2e_latency)
        for hist, value in ((self.queue_time, req.queue_time), (self.prefill_time, req.prefill_time),
                            (self.decode_time, req.decode_time), (self.tpot, req.time_per_output_token)):
            if value is not None:
                hist.labels(m).observe(value)

    def on_api_call(self, protocol: str, method: str, code: str, duration: float) -> None:
        """protocol: grpc | http; code: the gRPC status code name or the HTTP status."""
        self.api_requests.labels(self.model_name, protocol, method, code).inc()
        self.api_duration.labels(self.model_name, protocol, method).observe(duration)
