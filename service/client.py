"""A small Python client for the Inference service."""
from __future__ import annotations

from collections.abc import Iterator
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


def make_channel(target: str, tls_ca_file: str | None = None, tls_cert_file: str | None = None,
                 tls_key_file: str | None = None) -> grpc.Channel:
    """Plaintext, or TLS when a CA file is given (plus a client certificate for mutual TLS)."""
    if tls_ca_file is None:
        return grpc.insecure_channel(target)
    read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
    creds = grpc.ssl_channel_credentials(read(tls_ca_file), read(tls_key_file), read(tls_cert_file))
    return grpc.secure_channel(target, creds)


class InferenceClient:
    """Blocking client: `for chunk in client.generate("Hi", max_tokens=20): print(chunk.text)`.

    tls_ca_file turns on TLS (tls_cert_file/tls_key_file for mutual TLS); token is sent as
    `authorization: Bearer <token>` on every call."""

    def __init__(self, target: str = "localhost:50051", timeout: float | None = None, tls_ca_file: str | None = None,
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

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> InferenceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
