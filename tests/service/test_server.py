"""The server while its engine starts: gRPC health NOT_SERVING, and the start-up phase the engine
is in where a text can go (HTTP /health's body, UNAVAILABLE's details), then serving."""
from __future__ import annotations

import contextlib
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from engine import EngineConfig, LLMEngine
from engine.execution.startup_phases import PACKING, StartupPhases
from service.grpc.minivllm_client import InferenceClient
from tests.server_harness import ServerThread, poll


def _health(url: str) -> tuple[int, dict]:
    """GET /health's status and body; (0, {}) while nothing listens yet."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)
    except urllib.error.URLError:
        return 0, {}


def test_a_loading_server_says_which_phase_it_is_in(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's own engine factory (the one `minivllm serve` runs), held in its packing phase."""
    entered, release = threading.Event(), threading.Event()
    phase = StartupPhases.phase

    @contextlib.contextmanager
    def held_packing(self: StartupPhases, name: str) -> Iterator[None]:
        with phase(self, name):  # the listener has heard the name: hold the phase open
            if name == PACKING:
                entered.set()
                release.wait(60)
            yield

    monkeypatch.setattr(StartupPhases, "phase", held_packing)
    srv = ServerThread(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64), http_port=0, wait_ready=False)
    try:
        assert entered.wait(60)
        assert _health(srv.http_url) == (503, {"status": "loading", "phase": "packing"})
        with grpc.insecure_channel(srv.target) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING  # no text in this protocol
            vllm = vpb_grpc.VllmEngineStub(channel).HealthCheck(vpb.HealthCheckRequest(), timeout=10)
            assert not vllm.healthy and vllm.message == "model is still loading (packing)"  # vLLM's has one
        with InferenceClient(srv.target, timeout=10) as c, pytest.raises(grpc.RpcError) as err:
            c.model_info()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert err.value.details() == "model is still loading (packing)"
        release.set()
        assert poll(lambda: _health(srv.http_url)[0] == 200, 60)
        assert _health(srv.http_url) == (200, {"status": "ok"})
    finally:
        release.set()
        srv.stop()


def test_health_says_starting_before_the_engine_names_a_phase(tiny_model_dir: Path) -> None:
    """An engine factory of the caller's own reports no phase: the body says the start has begun."""
    release = threading.Event()
    config = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64)

    def held_factory() -> LLMEngine:
        release.wait(60)
        return LLMEngine(config)

    srv = ServerThread(config, http_port=0, engine_factory=held_factory, wait_ready=False)
    try:
        assert poll(lambda: _health(srv.http_url)[0] != 0, 30)  # the HTTP door listens before the engine starts
        assert _health(srv.http_url) == (503, {"status": "loading", "phase": "starting"})
        release.set()
        assert poll(lambda: _health(srv.http_url)[0] == 200, 60)
    finally:
        release.set()
        srv.stop()
