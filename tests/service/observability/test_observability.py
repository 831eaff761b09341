"""Metrics, a real Prometheus scraping them, the dashboard's every query, alert rules, traces."""
from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client import generate_latest

from engine import EngineConfig, StepStats
from service.grpc.minivllm_client import build_request
from service.observability.metrics import ServiceMetrics
from service.observability.tracing import Tracing, make_provider
from service.observability.wiring import MetricsInterceptor
from service.pb import inference_pb2 as pb
from service.pb import inference_pb2_grpc as pb_grpc
from tests.prometheus_queries import has_number, prom_query, prom_query_ok
from tests.server_harness import IN_CI, ServerThread, free_port, need
from tests.tiny_model import build_tiny_family_model, family_config

ROOT = Path(__file__).resolve().parents[3]


def metered_server(model: Path, metrics: ServiceMetrics, **engine_kw: object) -> ServerThread:
    """A server with metrics on both front doors (HTTP on a free port)."""
    kw = dict(model=str(model), num_kv_blocks=512, block_size=4, max_num_batched_tokens=64)
    kw.update(engine_kw)
    return ServerThread(EngineConfig(**kw), stats_listeners=[metrics.on_step],
                        interceptors=[MetricsInterceptor(metrics)], http_port=0, served_model_name="model",
                        on_http_call=metrics.on_api_call)


def _http_completion(srv: ServerThread, body: dict) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{srv.server.http.port}/v1/completions",
                                     data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def sample(metrics: ServiceMetrics, name: str, labels: dict[str, str] | None = None) -> float:
    value = metrics.registry.get_sample_value(name, labels or {"model_name": "model"})
    return 0.0 if value is None else value


async def _load(target: str, n: int, max_tokens: int = 8, prefix: str = "") -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceStub(channel)

        async def one(i: int) -> None:
            async for _ in stub.Generate(build_request(f"{prefix}request {i}", max_tokens=max_tokens,
                                                       ignore_eos=True, temperature=0)):
                pass

        await asyncio.gather(*(one(i) for i in range(n)))


def test_histogram_counts_match_what_happened(tiny_model_dir: Path) -> None:
    metrics = ServiceMetrics("model")
    srv = metered_server(tiny_model_dir, metrics)
    try:
        asyncio.run(_load(srv.target, 6, max_tokens=9))
        with grpc.insecure_channel(srv.target) as channel, pytest.raises(grpc.RpcError):
            list(pb_grpc.InferenceStub(channel).Generate(build_request("x", temperature=-1)))
    finally:
        srv.stop()
    assert sample(metrics, "minivllm_time_to_first_token_seconds_count") == 6
    assert sample(metrics, "minivllm_e2e_request_latency_seconds_count") == 6
    assert sample(metrics, "minivllm_request_queue_time_seconds_count") == 6
    assert sample(metrics, "minivllm_request_time_per_output_token_seconds_count") == 6
    assert sample(metrics, "minivllm_inter_token_latency_seconds_count") == 6 * 8  # 9 tokens: 8 gaps each
    assert sample(metrics, "minivllm_generation_tokens_total") == 6 * 9
    assert sample(metrics, "minivllm_requests_finished_total", {"model_name": "model", "finish_reason": "length"}) == 6
    assert sample(metrics, "minivllm_decode_tokens_total") == 6 * 8
    grpc_call = {"model_name": "model", "protocol": "grpc", "method": "Generate"}
    assert sample(metrics, "minivllm_api_requests_total", grpc_call | {"code": "OK"}) == 6
    assert sample(metrics, "minivllm_api_requests_total", grpc_call | {"code": "INVALID_ARGUMENT"}) == 1
    assert sample(metrics, "minivllm_api_request_duration_seconds_count", grpc_call) == 7
    assert sample(metrics, "minivllm_requests_running") == 0 and sample(metrics, "minivllm_kv_cache_usage_ratio") == 0


def test_experts_touched_are_observed_for_moe_steps_only() -> None:
    metrics = ServiceMetrics("model")
    metrics.on_step(StepStats(step_id=0, start_time=0.0, num_decode_tokens=3))  # dense: no sample, not a zero
    assert metrics.registry.get_sample_value("minivllm_step_experts_touched_per_layer_count",
                                             {"model_name": "model"}) is None
    metrics.on_step(StepStats(step_id=1, start_time=0.0, num_decode_tokens=3, num_experts_touched=9, num_moe_layers=2))
    metrics.on_step(StepStats(step_id=2, start_time=0.0, num_moe_layers=2))  # no forward: nothing ran
    assert sample(metrics, "minivllm_step_experts_touched_per_layer_count") == 1
    assert sample(metrics, "minivllm_step_experts_touched_per_layer_sum") == 4.5


def test_streaming_handlers_of_both_styles_pass_the_metrics_interceptor(tiny_model_dir: Path) -> None:
    """Generate yields its messages; grpc.health.v1 Watch writes them with context.write (what
    client-side health checking calls): both must stream through the interceptor."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    metrics = ServiceMetrics("model")
    srv = metered_server(tiny_model_dir, metrics)
    try:
        with grpc.insecure_channel(srv.target) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()
        asyncio.run(_load(srv.target, 1))
    finally:
        srv.stop()
    assert sample(metrics, "minivllm_api_requests_total", {"model_name": "model", "protocol": "grpc",
                                                           "method": "Watch", "code": "CANCELLED"}) == 1


def test_exposition_passes_promtool(tiny_model_dir: Path) -> None:
    promtool = need("promtool")
    metrics = ServiceMetrics("model")
    srv = metered_server(tiny_model_dir, metrics)
    try:
        asyncio.run(_load(srv.target, 3))
    finally:
        srv.stop()
    proc = subprocess.run([promtool, "check", "metrics"], input=generate_latest(metrics.registry), capture_output=True)
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()


def test_promtool_checks_config_and_alert_rules() -> None:
    promtool = need("promtool")
    for args in (["check", "config", "prometheus.yml"], ["check", "rules", "alerts.yml"],
                 ["test", "rules", "alerts_test.yml"]):
        proc = subprocess.run([promtool, *args], cwd=ROOT / "prometheus", capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    alerts = re.findall(r"- alert: (\w+)", (ROOT / "prometheus" / "alerts.yml").read_text())
    tested = set(re.findall(r"alertname: (\w+)", (ROOT / "prometheus" / "alerts_test.yml").read_text()))
    assert alerts and set(alerts) <= tested, f"alerts without a promtool test: {set(alerts) - tested}"


@pytest.mark.parametrize("name", ["minivllm.json", "smg-gateway.json"])
def test_dashboard_matches_grafana_schema(name: str) -> None:
    node = need("node")
    if not (ROOT / "tests" / "node" / "node_modules" / "@grafana" / "schema").exists():
        if IN_CI:
            pytest.fail("tests/node/node_modules is required in CI (make test installs it)")
        pytest.skip("run `make test` to install tests/node packages")
    proc = subprocess.run([node, "tests/node/check_dashboard.mjs", f"grafana/dashboards/{name}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    dashboard = json.loads((ROOT / "grafana" / "dashboards" / name).read_text())
    assert {p["gridPos"]["y"] for p in dashboard["panels"]}, "panels need positions"
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


def test_compose_file_is_valid_and_gated_on_health() -> None:
    import yaml

    compose = need("docker-compose")
    proc = subprocess.run([compose, "config", "-q"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    config = yaml.safe_load(subprocess.run([compose, "config"], cwd=ROOT, capture_output=True, text=True).stdout)
    services = config["services"]
    assert {name for name, service in services.items() if not service.get("profiles")} == \
        {"minivllm", "proxy", "otel-collector", "jaeger", "prometheus", "alertmanager", "grafana"}
    # Scalable: replicas publish no host port (the proxy does), and Prometheus finds each by DNS.
    assert "ports" not in services["minivllm"] and {p["target"] for p in services["proxy"]["ports"]} == {50051, 8000}
    prometheus = yaml.safe_load((ROOT / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: [n for sd in job["dns_sd_configs"] for n in sd["names"]]
            for job in prometheus["scrape_configs"]}
    assert jobs["minivllm"] == ["minivllm", "minivllm-2"]
    # The `smg` profile: a second replica like the first, behind the SMG gateway, both scraped.
    assert {name for name, service in services.items() if service.get("profiles") == ["smg"]} == {"minivllm-2", "smg"}
    second = dict(services["minivllm-2"])
    assert second.pop("profiles") == ["smg"] and second == services["minivllm"]
    smg = services["smg"]
    args = smg["command"]
    assert "--backend=vllm" in args and "--policy=cache_aware" in args
    assert {a for a in args if a.startswith("grpc://")} == {"grpc://minivllm:50051", "grpc://minivllm-2:50051"}
    assert jobs["smg"] == ["smg"] and "--prometheus-port=" + str(next(
        sd["port"] for job in prometheus["scrape_configs"] if job["job_name"] == "smg" for sd in job["dns_sd_configs"]
    )) in args
    assert set(smg["depends_on"]) == {"minivllm", "minivllm-2"}
    assert not services["jaeger"]["image"].startswith("jaegertracing/all-in-one")  # Jaeger v1 is end of life
    env = services["minivllm"]["environment"]
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"].startswith("http://otel-collector:")
    for name in ("minivllm", "prometheus", "alertmanager", "grafana"):
        assert services[name]["healthcheck"]["test"], name
    # Every dependency on a service that has a healthcheck waits for it to be healthy.
    for name, service in services.items():
        for dep, cond in (service.get("depends_on") or {}).items():
            wanted = "service_healthy" if "healthcheck" in services[dep] else "service_started"
            assert cond["condition"] == wanted, f"{name} -> {dep}"


def test_alertmanager_collector_and_dockerfile() -> None:
    import yaml

    amtool = need("amtool")
    proc = subprocess.run([amtool, "check-config", "alertmanager/alertmanager.yml"], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    prometheus = yaml.safe_load((ROOT / "prometheus" / "prometheus.yml").read_text())
    assert prometheus["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["alertmanager:9093"]
    # No collector binary here: check the pipeline only names components the file defines.
    collector = yaml.safe_load((ROOT / "otel" / "collector.yaml").read_text())
    for pipeline in collector["service"]["pipelines"].values():
        for kind in ("receivers", "processors", "exporters"):
            assert set(pipeline.get(kind, [])) <= set(collector.get(kind) or {}), kind
    assert "otlp" in collector["receivers"] and collector["exporters"]["otlp/jaeger"]["endpoint"] == "jaeger:4317"
    lines = [line.split()[0:2] for line in (ROOT / "Dockerfile").read_text().splitlines()
             if line and not line.startswith((" ", "#"))]
    instructions = [" ".join(parts) for parts in lines]
    users = [i for i in instructions if i.startswith("USER ")]
    assert users and users[-1] not in ("USER root", "USER 0"), "the service must not run as root"
    order = [instructions.index(step) for step in ("COPY pyproject.toml", "COPY engine/execution/weights/checkpoint.py", "COPY engine")]
    assert order == sorted(order), "dependencies, then the model, then the source"


def _start_prometheus(prometheus: str, metrics_port: int, tmp_path: Path) -> tuple[subprocess.Popen, int]:
    """Prometheus on a free port. Its port must be named up front, so a port taken between
    picking and binding shows as an early exit, and we pick again."""
    config = tmp_path / "prometheus.yml"
    config.write_text(f"global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: minivllm\n"
                      f"    static_configs:\n      - targets: ['127.0.0.1:{metrics_port}']\n")
    for attempt in range(5):
        port = free_port()
        proc = subprocess.Popen([prometheus, f"--config.file={config}",
                                 f"--storage.tsdb.path={tmp_path / f'data{attempt}'}",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            if prom_query_ok(port, 'up{job="minivllm"} == 1'):
                return proc, port
            time.sleep(0.2)
        proc.terminate()
        proc.wait(10)
    raise AssertionError("prometheus never started and scraped the service")


def _wait_for_prom(port: int, expr: str, expected: float, timeout: float = 30.0) -> None:
    """Poll until Prometheus's latest sample of expr equals what the service holds now."""
    deadline = time.monotonic() + timeout
    while True:
        result = prom_query(port, expr)
        if result and float(result[0]["value"][1]) == expected:
            return
        assert time.monotonic() < deadline, f"prometheus never saw {expr} == {expected}: {result}"
        time.sleep(0.2)


def test_real_prometheus_scrapes_and_every_panel_has_data(tiny_model_dir: Path, tmp_path: Path) -> None:
    prometheus = need("prometheus")
    metrics = ServiceMetrics("model")
    metrics_port = metrics.serve(0, "127.0.0.1")
    # A small KV cache forces preemptions; shared prompt prefixes give prefix-cache hits; the
    # repeated text gives n-gram proposals to verify (speculative decoding's panel).
    srv = metered_server(tiny_model_dir, metrics, num_kv_blocks=48, max_num_seqs=16, speculative_method="ngram")
    # A tiny mixture-of-experts model beside it (the experts panel: a dense model has no samples there)
    moe = metered_server(build_tiny_family_model(tmp_path / "moe", family_config("qwen3-moe")), metrics,
                         num_kv_blocks=64)
    proc, prom_port = _start_prometheus(prometheus, metrics_port, tmp_path)
    try:
        shared = "The quick brown fox jumps over the lazy dog. " * 3
        generated = 'sum(minivllm_generation_tokens_total{model_name="model"})'
        for _ in range(3):
            asyncio.run(_load(srv.target, 16, max_tokens=40, prefix=shared))
            asyncio.run(_load(moe.target, 2, max_tokens=4))
            assert _http_completion(srv, {"prompt": shared, "max_tokens": 8}) == 200
            assert _http_completion(srv, {"prompt": shared, "max_tokens": 0}) == 400
            with grpc.insecure_channel(srv.target) as channel, pytest.raises(grpc.RpcError):
                list(pb_grpc.InferenceStub(channel).Generate(pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(
                    top_p=0))))
            # Each round is scraped before the next one starts, so rates see several points.
            _wait_for_prom(prom_port, generated, sample(metrics, "minivllm_generation_tokens_total"))
        assert sample(metrics, "minivllm_preemptions_total") > 0, "the load was meant to force preemptions"
        dashboard = json.loads((ROOT / "grafana" / "dashboards" / "minivllm.json").read_text())
        queries = [(panel["title"], target["expr"].replace("$model_name", ".*").replace("$instance", ".*")
                    .replace("$__rate_interval", "1m")) for panel in dashboard["panels"] for target in panel["targets"]]
        deadline = time.monotonic() + 20  # a rate over the last round needs one scrape after it
        while True:
            empty = [f"{title}: {expr} -> {result}" for title, expr in queries
                     if not has_number(result := prom_query(prom_port, expr))]
            if not empty or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert not empty, "panels without data:\n" + "\n".join(empty)
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        for name in ("model_name", "instance"):  # each variable's query finds its label's values
            match = re.fullmatch(r"label_values\((.*), (\w+)\)", variables[name]["query"]["query"])
            selector = match.group(1).replace("$model_name", ".*")
            expected = {"model_name": "model", "instance": f"127.0.0.1:{metrics_port}"}[name]
            assert {r["metric"][match.group(2)] for r in prom_query(prom_port, selector)} == {expected}
        # Imports into any Grafana: no panel names a datasource uid, they all use the variable.
        assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
        assert {json.dumps(p["datasource"]) for p in dashboard["panels"]} == {
            json.dumps({"type": "prometheus", "uid": "${datasource}"})}
        assert sample(metrics, "minivllm_api_requests_total", {"model_name": "model", "protocol": "http",
                                                               "method": "/v1/completions", "code": "400"}) == 3
    finally:
        proc.terminate()
        proc.wait(10)
        srv.stop()
        moe.stop()


TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"


def test_request_and_step_spans(tiny_model_dir: Path) -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing(make_provider(exporter, batch=False), "model", trace_steps=True)
    srv = ServerThread(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256), stats_listeners=[tracing.on_step],
                       observer=tracing)
    try:
        with grpc.insecure_channel(srv.target) as channel:
            stub = pb_grpc.InferenceStub(channel)
            metadata = (("traceparent", f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"),)
            for i in range(3):
                list(stub.Generate(build_request(f"trace me {i}", max_tokens=6, temperature=0.5, top_p=0.9,
                                                 ignore_eos=True), metadata=metadata))
    finally:
        srv.stop()
    spans = exporter.get_finished_spans()
    requests = [s for s in spans if s.kind is SpanKind.SERVER]
    assert len(requests) == 3
    for span in requests:
        assert format(span.context.trace_id, "032x") == TRACE_ID
        assert format(span.parent.span_id, "016x") == PARENT_SPAN_ID
        a = span.attributes
        assert a["gen_ai.request.max_tokens"] == 6 and abs(a["gen_ai.request.temperature"] - 0.5) < 1e-6
        assert abs(a["gen_ai.request.top_p"] - 0.9) < 1e-6 and a["gen_ai.response.id"].startswith("req-")
        assert a["gen_ai.provider.name"] == "minivllm" and "gen_ai.system" not in a
        assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.model"] == "model"
        assert a["gen_ai.usage.output_tokens"] == 6 and a["gen_ai.usage.input_tokens"] > 0
        assert a["gen_ai.usage.cache_read.input_tokens"] >= 0 and a["gen_ai.response.finish_reasons"] == ("length",)
        assert a["rpc.grpc.status_code"] == 0 and "error.type" not in a
        for key in ("minivllm.latency.time_to_first_token", "minivllm.latency.time_in_queue",
                    "minivllm.latency.time_in_model_prefill", "minivllm.latency.time_in_model_decode",
                    "minivllm.latency.e2e"):
            assert a[key] >= 0
        assert [e.name for e in span.events] == ["queued", "scheduled", "first_token", "finished"]
        children = sorted(s.name for s in spans if s.parent is not None and s.parent.span_id == span.context.span_id)
        assert children == ["decode", "prefill", "queue"]
    steps = [s for s in spans if s.name == "engine.step"]
    assert steps
    assert sum(s.attributes["minivllm.step.decode_tokens"] for s in steps) == 3 * 5
    assert sum(s.attributes["minivllm.step.prefill_tokens"] for s in steps) == sum(
        r.attributes["gen_ai.usage.input_tokens"] for r in requests)
    request_ids = {r.context.span_id for r in requests}
    assert all({link.context.span_id for link in s.links} <= request_ids for s in steps)
    assert any(s.links for s in steps)


def _one_traced_request(model_dir: Path, tracing: Tracing, prompt: str, max_tokens: int) -> None:
    """One Generate through a server traced by `tracing` (step spans too, if it records them),
    then every span flushed to its exporter."""
    srv = ServerThread(EngineConfig(model=str(model_dir), num_kv_blocks=128), stats_listeners=[tracing.on_step],
                       observer=tracing)
    try:
        with grpc.insecure_channel(srv.target) as channel:
            list(pb_grpc.InferenceStub(channel).Generate(build_request(prompt, max_tokens=max_tokens)))
    finally:
        srv.stop()
        tracing.provider.force_flush()
        tracing.shutdown()


def test_spans_reach_an_otlp_receiver(tiny_model_dir: Path) -> None:
    from concurrent import futures

    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received: list[str] = []

    class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 - gRPC method name
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    received.extend(span.name for span in ss.spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    collector = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), collector)
    port = collector.add_insecure_port("127.0.0.1:0")
    collector.start()
    tracing = Tracing(make_provider(OTLPSpanExporter(endpoint=f"127.0.0.1:{port}", insecure=True)), "model",
                      trace_steps=True)
    try:
        _one_traced_request(tiny_model_dir, tracing, "otlp", 4)
    finally:
        collector.stop(0)
    assert "text_completion model" in received and "engine.step" in received and "prefill" in received


def test_otlp_protocol_follows_the_standard_variables(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """http/protobuf (the specification's default) to an HTTP receiver; grpc when asked; a typo is refused."""
    import http.server
    import threading

    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    from service.observability.tracing import make_otlp_exporter

    received: list[str] = []

    class Receiver(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["content-length"]))
            request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
            received.extend(f"{self.path} {span.name}" for rs in request.resource_spans for ss in rs.scope_spans
                            for span in ss.spans)
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.end_headers()
            self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{httpd.server_port}")
    try:
        _one_traced_request(tiny_model_dir, Tracing(make_provider(), "model"), "otlp over http", 3)
    finally:
        httpd.shutdown()
    assert "/v1/traces text_completion model" in received, received
    assert not any("engine.step" in r for r in received)  # step spans are opt-in
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    assert type(make_otlp_exporter()).__module__.startswith("opentelemetry.exporter.otlp.proto.grpc")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    assert type(make_otlp_exporter()).__module__.startswith("opentelemetry.exporter.otlp.proto.http")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        make_otlp_exporter()
