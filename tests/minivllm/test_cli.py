"""`minivllm serve` flags and MINIVLLM_* environment variables become a typed EngineConfig.

`minivllm generate` and `minivllm info` as a person uses them, against a live server.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine
from minivllm.cli import add_engine_args, engine_config_from_args
from service.grpc.minivllm_client import InferenceClient
from tests.server_harness import ServerThread


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(argv)


def test_env_vars_arrive_typed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINIVLLM_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("MINIVLLM_MIN_PREFILL_SHARE", "0.5")
    monkeypatch.setenv("MINIVLLM_ENABLE_PREFIX_CACHING", "false")
    config = engine_config_from_args(_parse(["--block-size", "8"]))
    assert config.max_num_seqs == 7 and config.min_prefill_share == 0.5
    assert config.enable_prefix_caching is False and config.block_size == 8
    assert config.model is None and config.max_num_batched_tokens == 2048  # untouched defaults


def test_flags_override_env_and_bad_values_name_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINIVLLM_MAX_NUM_SEQS", "7")
    assert engine_config_from_args(_parse(["--max-num-seqs", "3"])).max_num_seqs == 3
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine_config_from_args(_parse(["--max-num-seqs", "0"]))


def test_boolean_flags_take_no_value_and_typos_in_env_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    assert engine_config_from_args(_parse(["--no-enable-prefix-caching"])).enable_prefix_caching is False
    assert engine_config_from_args(_parse(["--enable-time-budget"])).enable_time_budget is True
    with pytest.raises(SystemExit):  # a value after a boolean flag is an unknown argument, not False
        _parse(["--enable-prefix-caching", "ture"])
    monkeypatch.setenv("MINIVLLM_ENABLE_PREFIX_CACHING", "ture")
    with pytest.raises(SystemExit, match="MINIVLLM_ENABLE_PREFIX_CACHING"):
        _parse([])


def test_every_flag_has_help_from_the_config_docs(capsys: pytest.CaptureFixture[str]) -> None:
    import dataclasses

    from engine import EngineConfig
    from minivllm.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for f in dataclasses.fields(EngineConfig):
        assert " ".join(f.metadata["help"].split()) in text, f.name
    for flag in ("--http-port", "--metrics-port", "--drain-grace", "--auth-token-file"):
        assert flag in text
    serve = next(a for a in build_parser()._subparsers._group_actions[0].choices["serve"]._actions
                 if a.dest == "max_num_seqs")
    assert serve.help and "MINIVLLM_MAX_NUM_SEQS" in serve.help


def test_version_and_log_level(capsys: pytest.CaptureFixture[str]) -> None:
    from minivllm.cli import build_parser

    with pytest.raises(SystemExit) as info:
        build_parser(with_serve_args=False).parse_args(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.startswith("minivllm ")
    assert build_parser(with_serve_args=False).parse_args(["--log-level", "debug", "info"]).log_level == "DEBUG"


def test_threads_follow_the_cgroup_quota_and_affinity(tmp_path: Path) -> None:
    import os

    from engine.config import usable_cpus

    affinity = len(os.sched_getaffinity(0))
    assert usable_cpus(tmp_path) == affinity  # no cgroup file: the affinity mask
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cpus(tmp_path) == affinity
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a CPU still gets one thread
    assert usable_cpus(tmp_path) == 1
    (tmp_path / "cpu.max").write_text(f"{100000 * (affinity + 8)} 100000\n")  # quota above affinity: affinity
    assert usable_cpus(tmp_path) == affinity


ROOT = Path(__file__).resolve().parents[2]


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
