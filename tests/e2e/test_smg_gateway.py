"""The field's gateway in front, for real: two tiny-model replicas speaking vLLM's engine gRPC
contract behind the real SMG binary (`smg launch --backend vllm --policy cache_aware`, from the
`smg` wheel), driven with the official `openai` SDK. The gateway tokenizes (with the tokenizer
the workers point it to), applies the chat template, parses tool calls, routes requests that share
a prefix to the replica whose KV events say it holds it, stops sending to a replica that drains
(SIGTERM), and takes a SIGKILLed replica out while every later request succeeds. Bounded: each call has a deadline, the whole test a few tens of s."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from service.grpc.minivllm_client import InferenceClient
from tests.prometheus_queries import has_number, prom_query, prom_query_ok
from tests.server_harness import ServerProcess, free_port, need, poll

ROOT = Path(__file__).resolve().parents[2]

IN_CI = os.environ.get("CI") == "true"
CALL_TIMEOUT = 30.0
SYSTEM = "You are a careful assistant. " + " ".join(f"Rule {i}: answer briefly, politely and in order."
                                                    for i in range(30))


def _smg_binary() -> str:
    path = Path(sys.executable).parent / "smg"
    if not path.exists():
        if IN_CI:
            pytest.fail("the smg gateway is required in CI (pyproject's test extra installs it)")
        pytest.skip("smg not installed: pip install -e '.[test]'")
    return str(path)


def _metric(port: int, name: str, *labels: str) -> float:
    """The sum of a metric's series that carry every given label="value"."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(value) for series, value in re.findall(rf"^{name}\{{([^}}]*)\}} ([0-9.e+]+)$", text, re.M)
               if all(label in series for label in labels))


class Replica:
    def __init__(self, model_dir: Path) -> None:
        self.metrics_port = free_port()
        self.server = ServerProcess(model_dir, "--num-kv-blocks", "1024", "--metrics-port", str(self.metrics_port),
                                    "--served-model-name", "tiny")

    def generates(self) -> float:
        """Generate calls this replica finished OK through the vLLM contract."""
        return _metric(self.metrics_port, "minivllm_api_requests_total", 'method="Generate"',
                       'protocol="grpc-vllm"', 'code="OK"')

    def prefix_hits(self) -> float:
        return _metric(self.metrics_port, "minivllm_prefix_cache_hits_total")


def _start_prometheus(targets: list[str], tmp_path: Path) -> tuple[subprocess.Popen, int]:
    """A real Prometheus scraping the gateway and the replicas every second."""
    config = tmp_path / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: fleet\n    static_configs:\n"
                      f"      - targets: {json.dumps(targets)}\n")
    port = free_port()
    proc = subprocess.Popen([need("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    assert poll(lambda: prom_query_ok(port, f'count(up == 1) == {len(targets)}'), 30), \
        "prometheus did not scrape the fleet"
    return proc, port


@pytest.fixture()
def fleet(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[list[Replica], str, int, int]]:
    smg = _smg_binary()
    replicas = [Replica(tiny_model_dir) for _ in range(3)]
    port, prometheus_port = free_port(), free_port()
    gateway = subprocess.Popen(
        [smg, "launch", "--backend", "vllm", "--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(port),
         "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port),
         "--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--log-level", "warn",
         "--worker-urls", *[f"grpc://{r.server.target}" for r in replicas]],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen: list[object] = []

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/workers", timeout=2) as resp:
                    workers = json.loads(resp.read())["workers"]
            except OSError:
                return False
            seen[:] = [(w["model_id"], w.get("status"), w["is_healthy"]) for w in workers]
            return len(workers) == len(replicas) and all(w["is_healthy"] and w.get("status") == "ready"
                                             and w["model_id"] == "tiny" for w in workers)

        assert poll(ready, 90), seen

        def answers_chat() -> bool:  # 503 tokenizer_not_ready until the gateway has loaded the tokenizer
            body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                               "max_tokens": 1}).encode()
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                             {"content-type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=30) as resp:
                    return resp.status == 200
            except OSError:
                return False

        assert poll(answers_chat, 60), "the gateway never answered a chat"
        scraper, scraper_port = _start_prometheus(
            [f"127.0.0.1:{p}" for p in (prometheus_port, *(r.metrics_port for r in replicas))], tmp_path)
        try:
            yield replicas, f"http://127.0.0.1:{port}/v1", prometheus_port, scraper_port
        finally:
            scraper.terminate()
            scraper.wait(10)
    finally:
        gateway.send_signal(signal.SIGTERM)
        try:
            gateway.wait(10)
        except subprocess.TimeoutExpired:
            gateway.kill()
        for r in replicas:
            r.server.close()


def test_smg_gateway_streams_parses_tools_routes_by_prefix_and_survives_sigkill(
        fleet: tuple[list[Replica], str, int, int]) -> None:
    replicas, base_url, prometheus_port, scraper_port = fleet
    started = time.monotonic()
    client = OpenAI(base_url=base_url, api_key="unused", timeout=CALL_TIMEOUT, max_retries=0)
    messages = [{"role": "user", "content": "Hello there"}]

    # Streaming chat: the gateway's template and detokenizer over our token ids equal a direct call.
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 16 and len([c for c in chunks if c.choices]) > 2
    with InferenceClient(replicas[0].server.target, timeout=CALL_TIMEOUT) as direct:
        assert text == "".join(r.text for r in direct.generate(messages, max_tokens=16, temperature=0,
                                                               ignore_eos=True))
        completion = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=8,
                                               temperature=0, extra_body={"ignore_eos": True})
        assert completion.choices[0].text == direct.complete("The quick brown fox", max_tokens=8, temperature=0,
                                                             ignore_eos=True)[0]
        assert completion.usage.completion_tokens == 8

    # A tool call, parsed by the gateway (the engine constrains the arguments to the schema).
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"], "additionalProperties": False}}}
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather?"}],
                                           tools=[tool], max_tokens=600, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")

    # Requests that share a long prefix land on one replica, which serves it from its cache.
    before = [(r.generates(), r.prefix_hits()) for r in replicas]
    for i in range(6):
        list(client.chat.completions.create(model="tiny", max_tokens=4, temperature=0, stream=True, messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}?"}]))
        time.sleep(0.1)  # the first request's KV events reach the gateway's index
    after = [(r.generates(), r.prefix_hits()) for r in replicas]
    calls = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    hits = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    assert sorted(calls) == [0, 0, 6], calls
    holder = calls.index(6)
    others = [i for i in range(len(replicas)) if i != holder]
    assert hits[holder] >= 5 * 16 * 8 and all(hits[i] == 0 for i in others), hits  # the prompt: > 8 blocks of 16
    # The gateway picked the holder because its KV events said so (the policy's event_hit branch).
    assert _metric(prometheus_port, "smg_cache_aware_policy_branch_total", 'branch="event_hit"') >= 5
    # Every panel of the gateway dashboard has data from a real Prometheus scraping the fleet.
    dashboard = json.loads((ROOT / "grafana" / "dashboards" / "smg-gateway.json").read_text())
    queries = [(panel["title"], target["expr"].replace("$model_name", ".*").replace("$__rate_interval", "1m"))
               for panel in dashboard["panels"] for target in panel["targets"]]
    empty: list[str] = []

    def every_panel_has_data() -> bool:
        empty[:] = [f"{title}: {expr}" for title, expr in queries if not has_number(prom_query(scraper_port, expr))]
        if empty:  # a rate needs its counter to move between two scrapes: traffic goes on, as under load
            list(client.chat.completions.create(model="tiny", max_tokens=2, temperature=0, stream=True,
                                                messages=[{"role": "user", "content": "Still there?"}]))
        return not empty

    assert poll(every_panel_has_data, 30), "panels without data:\n" + "\n".join(empty)

    # A replica that drains (SIGTERM) gets no new request; it stops, and every request succeeds.
    drained, survivor = replicas[others[0]], replicas[others[1]]
    drained.server.proc.send_signal(signal.SIGTERM)
    before_drain = replicas[holder].generates() + survivor.generates()
    for i in range(4):
        client.completions.create(model="tiny", prompt=f"During the drain {i}", max_tokens=3, temperature=0)
    assert drained.server.proc.wait(30) == 0
    assert replicas[holder].generates() + survivor.generates() == before_drain + 4

    # SIGKILL the replica that holds the prefix: every later request succeeds on the last one.
    replicas[holder].server.proc.send_signal(signal.SIGKILL)
    before_survivor = survivor.generates()
    for i in range(8):
        if i % 2:
            out = client.chat.completions.create(model="tiny", max_tokens=4, temperature=0, messages=[
                {"role": "system", "content": SYSTEM}, {"role": "user", "content": f"After {i}?"}])
            assert out.choices[0].finish_reason in ("length", "stop")
        else:
            parts = list(client.chat.completions.create(model="tiny", max_tokens=4, temperature=0, stream=True,
                                                        messages=[{"role": "user", "content": f"After {i}?"}]))
            assert any(p.choices and p.choices[0].finish_reason for p in parts)
    assert survivor.generates() == before_survivor + 8
    assert time.monotonic() - started < 120
