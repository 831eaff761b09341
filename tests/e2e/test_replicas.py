"""Several replicas on one machine, as a Kubernetes Deployment runs them: behind the real nginx
(deploy/nginx/nginx.conf, per-call gRPC balancing) and, separately, behind gRPC's own client-side
round_robin with a retry policy. Each replica's own metrics show its share; a SIGTERM drain cuts
no stream; a SIGKILL fails only the dead replica's streams, with a status, and every new call
succeeds on the survivors; nothing hangs."""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from service.grpc.minivllm_client import InferenceClient
from tests.server_harness import ServerProcess, free_port, poll

ROOT = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI") == "true"
CALL_TIMEOUT = 120.0  # no call may hang: each one has a deadline well above its normal length


class Replica:
    def __init__(self, model_dir: Path) -> None:
        self.metrics_port = free_port()
        self.server = ServerProcess(model_dir, "--num-kv-blocks", "512", "--metrics-port", str(self.metrics_port),
                                    "--drain-grace", "60")

    def is_serving(self) -> bool:
        with grpc.insecure_channel(self.server.target) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
            except grpc.RpcError:
                return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def num_ok_generates(self) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "minivllm_api_requests_total" and sample.labels.get("method") == "Generate" \
                        and sample.labels.get("code") == "OK":
                    return sample.value
        return 0.0


@pytest.fixture()
def replicas(tiny_model_dir: Path) -> Iterator[list[Replica]]:
    started = [Replica(tiny_model_dir) for _ in range(3)]
    try:
        assert poll(lambda: all(r.is_serving() for r in started), 120), [r.server.output for r in started]
        yield started
    finally:
        for r in started:
            r.server.close()


@pytest.fixture()
def nginx_bin() -> str:
    path = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if path is None:
        if IN_CI:
            pytest.fail("nginx is required in CI (make test installs it)")
        pytest.skip("nginx not installed: run `make test`")
    return path


def render_nginx_conf(grpc_addresses: list[str], grpc_port: int, http_port: int,
                      http_addresses: tuple[str, ...] = ("127.0.0.1:1",)) -> str:
    """deploy/nginx/nginx.conf with its upstreams pointing at the given replicas and its listen
    ports moved to free ones (the file itself names the compose service `minivllm`)."""
    conf = (ROOT / "deploy" / "nginx" / "nginx.conf").read_text()
    for port, addresses in (("50051", grpc_addresses), ("8000", http_addresses)):
        servers = "".join(f"    server {a} max_fails=1 fail_timeout=10s;\n" for a in addresses)
        conf = re.sub(rf"    server minivllm:{port} [^\n]*\n", servers, conf)
    conf = conf.replace("listen 50051 http2;", f"listen 127.0.0.1:{grpc_port} http2;")
    return conf.replace("listen 8000;", f"listen 127.0.0.1:{http_port};")


def test_nginx_config_passes_nginx_t(nginx_bin: str, tmp_path: Path) -> None:
    conf = tmp_path / "nginx.conf"
    conf.write_text(render_nginx_conf(["127.0.0.1:1"], free_port(), free_port()))
    proc = subprocess.run([nginx_bin, "-t", "-c", str(conf), "-p", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.fixture()
def target(request: pytest.FixtureRequest, replicas: list[Replica], tmp_path: Path) -> Iterator[str]:
    """The address clients use: nginx in front of the replicas, or all replicas for round_robin."""
    if request.param == "client":
        yield ",".join(r.server.target for r in replicas)
        return
    nginx = request.getfixturevalue("nginx_bin")
    port = free_port()
    conf = tmp_path / "nginx.conf"
    conf.write_text(render_nginx_conf([r.server.target for r in replicas], port, free_port()))
    proc = subprocess.Popen([nginx, "-c", str(conf), "-p", str(tmp_path), "-g", "daemon off;"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def up() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0

        assert poll(up, 20), "nginx did not start"
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def _complete(client: InferenceClient, prompt: str, max_tokens: int) -> tuple[str, int]:
    """(status code name, tokens received) of one stream."""
    received = 0
    try:
        for chunk in client.generate(prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0):
            received += len(chunk.token_ids)
    except grpc.RpcError as err:
        return err.code().name, received
    return "OK", received


@pytest.mark.parametrize("target", ["nginx", "client"], indirect=True)
def test_replicas_share_load_drain_cleanly_and_survive_sigkill(replicas: list[Replica], target: str) -> None:
    a, b, c = replicas
    with InferenceClient(target, timeout=CALL_TIMEOUT) as client, ThreadPoolExecutor(48) as pool:
        # 40 concurrent streams are spread over every replica; each replica's metrics show its share.
        results = list(pool.map(lambda i: _complete(client, f"spread {i}", 8), range(40)))
        assert results == [("OK", 8)] * 40
        shares = [r.num_ok_generates() for r in replicas]
        assert sum(shares) == 40 and all(s > 0 for s in shares), shares

        # SIGTERM drain of A while streams run on every replica: no stream is cut, and calls
        # started during the drain succeed elsewhere.
        running = [pool.submit(_complete, client, f"drain {i}", 200) for i in range(12)]
        assert poll(lambda: _active(a) > 0, 30)
        a.server.proc.send_signal(signal.SIGTERM)
        during = [pool.submit(_complete, client, f"during {i}", 4) for i in range(10)]
        assert [f.result(CALL_TIMEOUT) for f in running] == [("OK", 200)] * 12
        during_outcomes = [f.result(CALL_TIMEOUT) for f in during]
        assert during_outcomes == [("OK", 4)] * 10, during_outcomes
        assert a.server.proc.wait(60) == 0

        # SIGKILL of B mid-run: its streams fail with a status, C's finish, new calls all succeed.
        before_c = c.num_ok_generates()
        running = [pool.submit(_complete, client, f"kill {i}", 300) for i in range(12)]
        assert poll(lambda: _active(b) > 0 and _active(c) > 0, 30)
        b.server.proc.send_signal(signal.SIGKILL)
        outcomes = [f.result(CALL_TIMEOUT) for f in running]
        failed = [o for o in outcomes if o[0] != "OK"]
        assert failed and all(code in ("UNAVAILABLE", "INTERNAL", "UNKNOWN") for code, _ in failed), outcomes
        assert [o for o in outcomes if o[0] == "OK"] == [("OK", 300)] * (len(outcomes) - len(failed))
        after = [pool.submit(_complete, client, f"after {i}", 4) for i in range(10)]
        assert [f.result(CALL_TIMEOUT) for f in after] == [("OK", 4)] * 10
        assert c.num_ok_generates() >= before_c + 10 + (len(outcomes) - len(failed))


def _active(replica: Replica) -> float:
    """Requests running on a replica now (its minivllm_requests_running gauge)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{replica.metrics_port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return 0.0
    match = re.search(r"^minivllm_requests_running\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0
