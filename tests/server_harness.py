"""Runs an InferenceServer on 127.0.0.1 in a background thread with its own event loop."""
from __future__ import annotations

import asyncio
import os
import queue
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine
from service.async_engine import StatsListener
from service.grpc.minivllm_servicer import RequestObserver
from service.server import InferenceServer, ServerConfig

IN_CI = os.environ.get("CI") == "true"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        if IN_CI:
            pytest.fail(f"{tool} is required in CI (make test installs it)")
        pytest.skip(f"{tool} not installed: run `make test`")
    return path



class ServerThread:
    def __init__(self, engine_config: EngineConfig, stats_listeners: list[StatsListener] | None = None,
                 observer: RequestObserver | None = None, interceptors: list | None = None,
                 engine_factory: Callable[[], LLMEngine] | None = None, wait_ready: bool = True,
                 on_http_call: Callable[[str, str, str, float], None] | None = None,
                 **server_options: object) -> None:
        self.config = ServerConfig(host="127.0.0.1", port=0, drain_grace_s=10.0, engine=engine_config,
                                   **server_options)
        self._factory = engine_factory
        self._listeners, self._observer, self._interceptors = stats_listeners, observer, interceptors
        self._on_http_call = on_http_call
        self._ready = threading.Event()
        self._started = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.server: InferenceServer | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()
        if not self._started.wait(60):
            raise RuntimeError("server did not start")
        if wait_ready and not self._ready.wait(120):
            raise RuntimeError("server did not load its model")

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        try:
            self.server = InferenceServer(self.config, self._listeners, self._observer, self._interceptors,
                                          self._on_http_call)
        finally:
            self._started.set()
        await self.server.start(self._factory)
        self._ready.set()
        await self.server.wait_stopped()

    @property
    def loop_thread_id(self) -> int | None:
        """The thread running the server's event loop."""
        return self._thread.ident

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.server.http.port}"

    @property
    def engine(self) -> LLMEngine:
        return self.server.async_engine._engine  # the test looks inside

    def wait_until(self, predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.02)
        return predicate()

    def join(self, timeout: float) -> bool:
        """Wait for a server that stops on its own (a drain the test ran); True once it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> None:
        if self.loop is not None and self.server is not None:
            asyncio.run_coroutine_threadsafe(self.server.drain_and_stop(), self.loop).result(30)
        self._thread.join(30)


def poll(predicate: Callable[[], bool], timeout: float) -> bool:
    """Wait until predicate() holds (checked every 50 ms); False if it never did."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class ServerProcess:
    """`minivllm serve` as a child process on a port it picks itself (port 0, read back from its
    log: no pick-then-bind race); its output is collected on a thread."""

    def __init__(self, model_dir: Path, *args: str, env: dict[str, str] | None = None,
                 command: list[str] | None = None, cwd: Path | None = None) -> None:
        """command: how to run the CLI (default: this interpreter's `-m minivllm`); later flags
        in args override the defaults here (HTTP off, metrics off)."""
        command = command or [sys.executable, "-m", "minivllm"]
        self.proc = subprocess.Popen(
            [*command, "serve", "--model", str(model_dir), "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
             "--http-port", "0", *args], env=dict(os.environ, MINIVLLM_LOG_LEVEL="INFO", **(env or {})),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd)
        self.lines: list[str] = []
        self._new: queue.SimpleQueue[str] = queue.SimpleQueue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.port = self._wait_for_port(120.0)

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            self._new.put(line)

    def _wait_for_port(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while True:
            line = self._new.get(timeout=max(0.1, deadline - time.monotonic()))
            match = re.search(r"gRPC listening on [^ ]+:(\d+)", line)
            if match:
                return int(match.group(1))

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def served_embeddings(model: Path, texts: list[str], *args: str) -> tuple[list[list[float]], int]:
    """`minivllm serve --model model` (extra args after it) as an embedding server, asked through the
    openai SDK: each text's vector and the usage's prompt tokens. Asserts what every embedding
    server must: it starts with task embed, refuses the generation routes, and logs no traceback."""
    import openai

    http_port = free_port()
    server = ServerProcess(model, "--http-port", str(http_port), "--num-kv-blocks", "128", *args)
    try:
        assert poll(lambda: "loaded; serving" in server.output or server.proc.poll() is not None, 300), server.output
        assert server.proc.poll() is None, server.output
        with openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="x", max_retries=0,
                           timeout=120) as client:
            name = client.models.list().data[0].id
            result = client.embeddings.create(model=name, input=texts)
            with pytest.raises(openai.BadRequestError):
                client.completions.create(model=name, prompt="hello", max_tokens=2)
    finally:
        server.close()
    assert "task embed" in server.output and "Traceback" not in server.output, server.output
    return [d.embedding for d in result.data], result.usage.prompt_tokens
