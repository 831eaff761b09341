"""TLS, mutual TLS and bearer tokens on the gRPC server, with certificates made in the test."""
from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine import EngineConfig
from service.grpc.minivllm_client import InferenceClient
from service.grpc.security import TokenAuthInterceptor
from tests.server_harness import ServerThread


def _ok(client: InferenceClient) -> bool:
    return client.complete("hello", max_tokens=3, ignore_eos=True)[2] == "length"


def test_tls_refuses_plaintext_and_serves_tls(tiny_model_dir: Path, pki: Path) -> None:
    srv = ServerThread(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64), tls_cert_file=str(pki / "server.pem"),
                       tls_key_file=str(pki / "server.key"))
    try:
        with InferenceClient(srv.target, timeout=10) as plain, pytest.raises(grpc.RpcError) as err:
            _ok(plain)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with InferenceClient(srv.target, timeout=30, tls_ca_file=str(pki / "ca.pem")) as client:
            assert _ok(client)
    finally:
        srv.stop()


def test_mutual_tls_needs_a_client_certificate(tiny_model_dir: Path, pki: Path) -> None:
    srv = ServerThread(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64), tls_cert_file=str(pki / "server.pem"),
                       tls_key_file=str(pki / "server.key"), tls_client_ca_file=str(pki / "ca.pem"))
    try:
        with InferenceClient(srv.target, timeout=10, tls_ca_file=str(pki / "ca.pem")) as anonymous, \
                pytest.raises(grpc.RpcError):
            _ok(anonymous)
        with InferenceClient(srv.target, timeout=30, tls_ca_file=str(pki / "ca.pem"),
                             tls_cert_file=str(pki / "client.pem"), tls_key_file=str(pki / "client.key")) as client:
            assert _ok(client)
    finally:
        srv.stop()


def test_bearer_tokens(tiny_model_dir: Path) -> None:
    srv = ServerThread(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64), auth_tokens=["s3cret", "other"])
    try:
        for token in (None, "wrong", "s3cret-but-longer"):
            with InferenceClient(srv.target, timeout=10, token=token) as client, pytest.raises(grpc.RpcError) as err:
                _ok(client)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, token
            with InferenceClient(srv.target, timeout=10, token=token) as client, pytest.raises(grpc.RpcError) as err:
                client.model_info()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for token in ("s3cret", "other"):
            with InferenceClient(srv.target, timeout=30, token=token) as client:
                assert _ok(client) and client.model_info().vocab_size > 0
        assert _bench_sends(srv.target, "s3cret") == ("", 4)  # `minivllm bench --token`
        assert "UNAUTHENTICATED" in _bench_sends(srv.target, None)[0]
        with grpc.insecure_channel(srv.target) as channel:  # probes need no token
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        srv.stop()


def _bench_sends(target: str, token: str | None) -> tuple[str, int]:
    import asyncio

    from bench.backends import GrpcBackend
    from bench.workloads import BenchRequest

    async def send() -> tuple[str, int]:
        backend = GrpcBackend(target, token=token)
        try:
            result = await backend.send(BenchRequest([5, 6, 7], 3, 4, True))
        finally:
            await backend.close()
        return result.error, result.output_len

    return asyncio.run(send())


def test_token_check_needs_the_bearer_scheme_and_an_exact_token() -> None:
    auth = TokenAuthInterceptor(["abc"])
    assert auth.is_valid("Bearer abc") and auth.is_valid("bearer abc")
    assert not any(auth.is_valid(h) for h in ("abc", "Basic abc", "Bearer ab", "Bearer abcd", "Bearer ", ""))
    with pytest.raises(ValueError):
        TokenAuthInterceptor([])
