"""How the benchmark talks to a server: minivllm's gRPC stream or an OpenAI-compatible HTTP
stream (vLLM, llama.cpp's server, TGI), timing every token the same way for both."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import grpc

from bench.workloads import BenchRequest
from service.grpc.minivllm_client import build_request, channel_options, channel_target
from service.pb import inference_pb2_grpc as pb_grpc


@dataclass(slots=True)
class RequestResult:
    prompt_len: int
    start: float  # monotonic
    token_times: list[float] = field(default_factory=list)  # arrival of each streamed chunk's tokens
    output_len: int = 0
    end: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.output_len > 0

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def e2el(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.output_len < 2 or not self.token_times:
            return None
        return (self.end - self.token_times[0]) / (self.output_len - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


class GrpcBackend:
    def __init__(self, target: str, tls_ca_file: str | None = None, token: str | None = None) -> None:
        """target: host:port, ip:port,ip:port (balanced) or dns:///name:port (every address)."""
        address = channel_target(target)
        options = channel_options(address)
        if tls_ca_file is None:
            self.channel = grpc.aio.insecure_channel(address, options=options)
        else:
            with open(tls_ca_file, "rb") as f:
                self.channel = grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(f.read()),
                                                       options=options)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.metadata = [("authorization", f"Bearer {token}")] if token else None

    async def send(self, req: BenchRequest) -> RequestResult:
        result = RequestResult(prompt_len=req.prompt_len, start=time.monotonic())
        try:
            call = self.stub.Generate(build_request(req.prompt, max_tokens=req.output_len, temperature=0,
                                                    ignore_eos=req.ignore_eos), metadata=self.metadata)
            async for chunk in call:
                now = time.monotonic()
                result.token_times.extend([now] * len(chunk.token_ids))
                result.output_len += len(chunk.token_ids)
                if chunk.usage.prompt_tokens:
                    result.prompt_len = chunk.usage.prompt_tokens
        except grpc.aio.AioRpcError as err:
            result.error = f"{err.code().name}: {err.details()}"
        result.end = time.monotonic()
        return result

    async def close(self) -> None:
        await self.channel.close()


class OpenAIBackend:
    """POST /v1/completions with stream: true; each SSE `data:` event is one or more tokens."""

    def __init__(self, base_url: str, model: str, chat: bool = False) -> None:
        """chat: chat messages go to /v1/chat/completions (the server applies the chat template)."""
        import aiohttp

        self.base_url = base_url.rstrip("/")
        self.url = self.base_url + "/v1/completions"
        self.model = model
        self.chat = chat
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def send(self, req: BenchRequest) -> RequestResult:
        prompt, url = req.prompt, self.url
        body = {"model": self.model, "max_tokens": req.output_len, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": req.ignore_eos}
        is_chat = bool(prompt) and isinstance(prompt, list) and isinstance(prompt[0], dict)
        if is_chat and self.chat:
            body["messages"], url = prompt, self.base_url + "/v1/chat/completions"
        else:
            body["prompt"] = "\n".join(m["content"] for m in prompt) if is_chat else prompt
        result = RequestResult(prompt_len=req.prompt_len, start=time.monotonic())
        try:
            async with self.session.post(url, json=body) as resp:
                if resp.status != 200:
                    result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                else:
                    await self._read_stream(resp, result)
        except Exception as exc:  # noqa: BLE001 - a failed request is a result, not a crash
            result.error = f"{type(exc).__name__}: {exc}"
        result.end = time.monotonic()
        return result

    @staticmethod
    async def _read_stream(resp: object, result: RequestResult) -> None:
        usage_tokens = None
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if event.get("usage"):
                usage_tokens = event["usage"].get("completion_tokens")
                result.prompt_len = event["usage"].get("prompt_tokens", result.prompt_len)
            choice = event["choices"][0] if event.get("choices") else {}
            if choice.get("text") or (choice.get("delta") or {}).get("content"):
                result.token_times.append(time.monotonic())
                result.output_len += 1
        if usage_tokens:  # servers may pack several tokens into one event
            result.output_len = usage_tokens

    async def close(self) -> None:
        await self.session.close()
