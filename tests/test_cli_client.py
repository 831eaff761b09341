"""`minivllm generate` and `minivllm info` as a person uses them, against a live server."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine
from service.grpc.minivllm_client import InferenceClient
from tests.server_harness import ServerThread

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minivllm", *args], input=stdin, capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> ServerThread:
    srv = ServerThread(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=128))
    yield srv
    srv.stop()


def test_generate_from_stdin_with_options_ends_with_a_newline(server: ServerThread) -> None:
    with InferenceClient(server.target) as client:
        expected, _, _ = client.complete([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                                         max_tokens=6, temperature=0.8, top_p=0.9, seed=3, ignore_eos=False)
    out = _cli("generate", "--target", server.target, "--system", "be brief", "--max-tokens", "6", "--temperature",
               "0.8", "--top-p", "0.9", "--seed", "3", stdin="hi")
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected + "\n"
    assert "finish_reason=" in out.stderr and "Traceback" not in out.stderr


def test_generate_stop_string(server: ServerThread) -> None:
    with InferenceClient(server.target) as client:
        text, _, _ = client.complete("once upon", max_tokens=12, temperature=0, ignore_eos=True)
    stop = text[3:5]
    if not stop.strip():
        pytest.skip("greedy text has no usable stop string")
    out = _cli("generate", "once upon", "--target", server.target, "--max-tokens", "12", "--stop", stop)
    assert out.returncode == 0 and out.stdout == text[:text.index(stop)] + "\n"


def test_info_json_and_text(server: ServerThread) -> None:
    out = _cli("info", "--json", "--target", server.target)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["max_model_len"] > 0 and info["block_size"] == 16 and info["has_chat_template"] is True
    text = _cli("info", "--target", server.target)
    assert f"max_model_len: {info['max_model_len']}" in text.stdout.splitlines()


def test_unreachable_and_loading_servers_are_one_line_errors(tiny_model_dir: Path) -> None:
    out = _cli("info", "--target", "127.0.0.1:9", "--timeout", "3")
    assert out.returncode == 1 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and "cannot reach" in out.stderr and "Traceback" not in out.stderr
    release = threading.Event()

    def slow_engine() -> LLMEngine:
        release.wait(60)
        return LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64))

    srv = ServerThread(EngineConfig(model=str(tiny_model_dir)), engine_factory=slow_engine, wait_ready=False)
    try:
        for args in (("info",), ("generate", "hello")):
            out = _cli(*args, "--target", srv.target)
            assert out.returncode == 1, out
            lines = out.stderr.strip().splitlines()
            assert len(lines) == 1 and "still loading" in lines[0], out.stderr
    finally:
        release.set()
        srv.stop()
