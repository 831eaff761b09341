"""Where the C++ kernels are built: one build per sources' content (and torch, and CPU kind),
shared by every install of those sources, so two installs never rebuild each other's; and when a
package's compiled kernels are taken instead (test_packaging builds and serves a real wheel)."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from engine.execution.kernels import build_sources, load_extension, load_shipped_kernels, sources_digest

KERNELS = Path(__file__).resolve().parents[4] / "engine" / "execution" / "kernels"


def _install(where: Path) -> Path:
    where.mkdir(parents=True)
    for path in KERNELS.iterdir():
        if path.suffix in (".cpp", ".h"):
            shutil.copy(path, where / path.name)
    return where


def test_two_installs_of_the_same_sources_share_one_build(tmp_path: Path) -> None:
    root, torch_dir = tmp_path / "cache", tmp_path / "torch"
    checkout, wheel = _install(tmp_path / "checkout"), _install(tmp_path / "venv" / "kernels")
    build, sources = build_sources(root, checkout, torch_dir, "2.13.0")
    assert build_sources(root, wheel, torch_dir, "2.13.0") == (build, sources)
    # The build compiles its own copy (same paths in its commands whoever loads it).
    assert sources.parent == build
    for path in checkout.iterdir():
        assert (sources / path.name).read_bytes() == path.read_bytes()
    mtime = (sources / "bindings.cpp").stat().st_mtime_ns
    build_sources(root, wheel, torch_dir, "2.13.0")
    assert (sources / "bindings.cpp").stat().st_mtime_ns == mtime  # not rewritten: ninja would rebuild


def test_other_sources_or_another_torch_build_apart(tmp_path: Path) -> None:
    root, torch_dir = tmp_path / "cache", tmp_path / "torch"
    checkout = _install(tmp_path / "checkout")
    build, _ = build_sources(root, checkout, torch_dir, "2.13.0")
    assert build_sources(root, checkout, torch_dir, "2.14.0")[0] != build
    assert build_sources(root, checkout, tmp_path / "other-torch", "2.13.0")[0] != build
    edited = _install(tmp_path / "edited")
    (edited / "simd_exp.h").write_text((edited / "simd_exp.h").read_text() + "\n// edited\n")
    other, other_sources = build_sources(root, edited, torch_dir, "2.13.0")
    assert other != build and (other_sources / "simd_exp.h").read_text().endswith("// edited\n")


def _shipped(where: Path, **changes: object) -> Path:
    """A package's kernel directory with its build record (as setup.py writes it), changed as asked."""
    import torch

    kernels = _install(where)
    info = {"torch": torch.__version__, "cxx11_abi": bool(torch.compiled_with_cxx11_abi()),
            "sources": sources_digest(kernels), "cflags": ["-O3"], **changes}
    (kernels / "_minivllm_cpu_kernels.json").write_text(json.dumps(info))
    return kernels


def test_compiled_kernels_are_taken_only_for_their_torch_and_sources(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    assert load_shipped_kernels(_install(tmp_path / "checkout")) is None  # no record: compile them, silently
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="engine.execution.kernels"):
        assert load_shipped_kernels(_shipped(tmp_path / "old-torch", torch="2.12.0+cpu")) is None
        assert "built for torch 2.12.0+cpu" in caplog.text
        caplog.clear()
        edited = _shipped(tmp_path / "edited")
        (edited / "simd_exp.h").write_text((edited / "simd_exp.h").read_text() + "\n// edited\n")
        assert load_shipped_kernels(edited) is None
        assert "sources changed" in caplog.text


def test_a_jit_build_says_so_once_with_its_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    from torch.utils import cpp_extension

    built = []

    def fake_load(name: str, build_directory: str, **kwargs: object) -> str:
        (Path(build_directory) / f"{name}.so").touch()
        built.append(name)
        return name

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    checkout = _install(tmp_path / "checkout")
    with caplog.at_level(logging.WARNING, logger="engine.execution.kernels"):
        assert load_extension("k", checkout, ("bindings.cpp",)) == "k"
        assert [r.getMessage().split(" ")[0] for r in caplog.records] == ["compiling", "compiled"]
        assert "-march=native" in caplog.records[0].getMessage()
        caplog.clear()
        assert load_extension("k", checkout, ("bindings.cpp",)) == "k"  # built: loads without a word
        assert not caplog.records and built == ["k", "k"]
