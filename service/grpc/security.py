"""Transport security for the gRPC server: TLS (optionally mutual) and bearer-token auth.

Tokens are compared in constant time (hmac.compare_digest) against every configured token, so
a wrong token takes as long to refuse as a right one takes to accept. Health checks and server
reflection stay open by default, so load balancers and probes need no secret.
"""
from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def load_tokens(token_file: str | None, env_var: str = "MINIVLLM_AUTH_TOKENS") -> list[str]:
    """Tokens from a file (one per line, # comments) and a comma-separated environment variable."""
    tokens = [t.strip() for t in os.environ.get(env_var, "").split(",") if t.strip()]
    if token_file:
        for line in Path(token_file).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                tokens.append(line)
    return tokens


def server_credentials(cert_file: str, key_file: str, client_ca_file: str | None = None) -> grpc.ServerCredentials:
    """TLS with the server's certificate; with a client CA, clients must present a certificate it signed."""
    ca = Path(client_ca_file).read_bytes() if client_ca_file else None
    return grpc.ssl_server_credentials([(Path(key_file).read_bytes(), Path(cert_file).read_bytes())],
                                       root_certificates=ca, require_client_auth=ca is not None)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Every call but the open ones needs `authorization: Bearer <token>` with a configured token."""

    def __init__(self, tokens: list[str], open_method_prefixes: tuple[str, ...] = OPEN_METHOD_PREFIXES) -> None:
        if not tokens:
            raise ValueError("auth tokens: at least one is needed")
        self._tokens = [t.encode() for t in tokens]
        self._open = open_method_prefixes

    def is_valid(self, header: str) -> bool:
        scheme, _, token = header.partition(" ")
        given = token.strip().encode()
        # Check every token (no early exit), so timing says nothing about which one is close.
        matches = [hmac.compare_digest(given, t) for t in self._tokens]
        return scheme.lower() == "bearer" and any(matches)

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable],
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or details.method.startswith(self._open):
            return handler
        metadata = dict(details.invocation_metadata or ())
        header = metadata.get("authorization", "")
        if isinstance(header, str) and self.is_valid(header):
            return handler
        message = "a valid bearer token is required" if header else "missing authorization: Bearer <token>"
        return _denying(handler, message)


def _denying(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    async def deny_unary(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(request: object, context: grpc.aio.ServicerContext):  # noqa: ANN202 - async generator
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # makes this an async generator, as a server-streaming handler must be

    codec = {"request_deserializer": handler.request_deserializer,
             "response_serializer": handler.response_serializer}
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **codec)
    return grpc.unary_unary_rpc_method_handler(deny_unary, **codec)
