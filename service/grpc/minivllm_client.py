"""A small Python client for the Inference service.

Targets: `host:port`, several as `ip:port,ip:port` (or a list), or a DNS name with every
replica's address (`dns:///minivllm-headless.ns.svc:50051`). The channel balances calls over all
addresses (gRPC's `round_robin`), skips replicas whose grpc.health.v1 status is not SERVING
(client-side health checking: a draining or loading replica gets no new calls), and retries a
call that failed with UNAVAILABLE before any response arrived (a replica that began draining or
died in between) on another one: all gRPC's own service config, not a loop of ours. A call that
has received a message is never retried (it would repeat tokens).
"""
from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from service.pb import inference_pb2 as pb
from service.pb import inference_pb2_grpc as pb_grpc


def build_request(prompt: str | list[int] | list[dict[str, str]], request_id: str = "", priority: int = 0,
                  **sampling: Any) -> pb.GenerateRequest:
    """prompt: text, token ids, or chat messages ([{"role": ..., "content": ...}])."""
    req = pb.GenerateRequest(request_id=request_id, sampling=pb.SamplingParams(**sampling), priority=priority)
    if isinstance(prompt, str):
        req.prompt = prompt
    elif prompt and isinstance(prompt[0], dict):
        req.messages.CopyFrom(pb.Messages(messages=[pb.ChatMessage(**m) for m in prompt]))
    else:
        req.prompt_token_ids.CopyFrom(pb.TokenIds(ids=list(prompt)))
    return req


SERVICE = "minivllm.v1.Inference"


def service_config(max_attempts: int = 5, health_check: bool = True) -> str:
    """round_robin over every (SERVING, with health_check) address, and UNAVAILABLE retried before
    the first response (5 attempts: gRPC's maximum)."""
    config: dict[str, Any] = {"loadBalancingConfig": [{"round_robin": {}}]}
    if health_check:
        config["healthCheckConfig"] = {"serviceName": SERVICE}
    return json.dumps(config | {
        "methodConfig": [{
            "name": [{"service": SERVICE}],
            "retryPolicy": {"maxAttempts": max_attempts, "initialBackoff": "0.05s", "maxBackoff": "1s",
                            "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
        }],
    })


def channel_target(target: str | Sequence[str]) -> str:
    """One gRPC target for one or several addresses. Several must be IP literals (gRPC's
    ipv4:/ipv6: schemes); for names, give one `dns:///name:port` that resolves to them all."""
    targets = [t.strip() for t in (target.split(",") if isinstance(target, str) else target) if t.strip()]
    if not targets:
        raise ValueError("target: empty")
    if len(targets) == 1:
        return targets[0]
    families = set()
    for t in targets:
        host = t.rsplit(":", 1)[0].strip("[]")
        try:
            families.add(ipaddress.ip_address(host).version)
        except ValueError:
            raise ValueError(f"target: {t!r}: several targets must be ip:port; for names use dns:///name:port") from None
    if len(families) != 1:
        raise ValueError("target: several targets must all be IPv4 or all IPv6")
    return f"ipv{families.pop()}:" + ",".join(targets)


def channel_options(target: str, max_attempts: int = 5) -> list[tuple[str, Any]]:
    """Client-side health checking only where the client balances (several addresses or a DNS
    name): one address may be a proxy, which checks its replicas itself (and nginx does not
    carry the health Watch stream)."""
    balances = target.startswith(("ipv4:", "ipv6:", "dns:"))
    return [("grpc.service_config", service_config(max_attempts, health_check=balances)), ("grpc.enable_retries", 1)]


def make_channel(target: str | Sequence[str], tls_ca_file: str | None = None, tls_cert_file: str | None = None,
                 tls_key_file: str | None = None) -> grpc.Channel:
    """Plaintext, or TLS when a CA file is given (plus a client certificate for mutual TLS);
    balanced and retrying over several targets (see the module doc)."""
    address = channel_target(target)
    options = channel_options(address)
    if tls_ca_file is None:
        return grpc.insecure_channel(address, options=options)
    read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
    creds = grpc.ssl_channel_credentials(read(tls_ca_file), read(tls_key_file), read(tls_cert_file))
    return grpc.secure_channel(address, creds, options=options)


class InferenceClient:
    """Blocking client: `for chunk in client.generate("Hi", max_tokens=20): print(chunk.text)`.

    tls_ca_file turns on TLS (tls_cert_file/tls_key_file for mutual TLS); token is sent as
    `authorization: Bearer <token>` on every call."""

    def __init__(self, target: str | Sequence[str] = "localhost:50051", timeout: float | None = None, tls_ca_file: str | None = None,
                 tls_cert_file: str | None = None, tls_key_file: str | None = None, token: str | None = None) -> None:
        self.channel = make_channel(target, tls_ca_file, tls_cert_file, tls_key_file)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.timeout = timeout
        self.metadata = [("authorization", f"Bearer {token}")] if token else None

    def generate(self, prompt: str | list[int] | list[dict[str, str]], request_id: str = "",
                 **sampling: Any) -> Iterator[pb.GenerateResponse]:
        return self.stub.Generate(build_request(prompt, request_id, **sampling), timeout=self.timeout,
                                  metadata=self.metadata)

    def complete(self, prompt: str | list[int] | list[dict[str, str]], **sampling: Any) -> tuple[str, list[int], str]:
        """Whole text, token ids and finish reason of one request."""
        text, ids, reason = [], [], ""
        for chunk in self.generate(prompt, **sampling):
            text.append(chunk.text)
            ids.extend(chunk.token_ids)
            reason = chunk.finish_reason or reason
        return "".join(text), ids, reason

    def model_info(self) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout, metadata=self.metadata)

    def tokenize(self, prompt: str) -> list[int]:
        return list(self.stub.Tokenize(pb.TokenizeRequest(prompt=prompt), timeout=self.timeout,
                                       metadata=self.metadata).token_ids)

    def embed(self, inputs: Sequence[str | list[int]], dimensions: int = 0, normalize: bool | None = None,
              pooling_type: str = "", request_id: str = "") -> list[list[float]]:
        """The embeddings of texts or token-id lists, in order (an embedding model's server)."""
        items = [pb.EmbedInput(prompt=x) if isinstance(x, str) else pb.EmbedInput(prompt_token_ids=pb.TokenIds(ids=x))
                 for x in inputs]
        request = pb.EmbedRequest(request_id=request_id, inputs=items, dimensions=dimensions, pooling_type=pooling_type)
        if normalize is not None:
            request.normalize = normalize
        response = self.stub.Embed(request, timeout=self.timeout, metadata=self.metadata)
        return [list(e.values) for e in response.embeddings]

    def score(self, query: str, documents: Sequence[str], instruction: str = "", request_id: str = "") -> list[float]:
        """Each document's relevance to the query, in order (a score model's server)."""
        request = pb.ScoreRequest(request_id=request_id, query=query, documents=list(documents),
                                  instruction=instruction)
        return list(self.stub.Score(request, timeout=self.timeout, metadata=self.metadata).scores)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> InferenceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
