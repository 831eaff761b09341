"""Where the C++ kernels are built: one build per sources' content (and torch, and CPU kind),
shared by every install of those sources, so two installs never rebuild each other's."""
from __future__ import annotations

import shutil
from pathlib import Path

from engine.execution.kernels import build_sources

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
