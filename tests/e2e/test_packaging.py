"""The package as a user installs it: a wheel built from this tree (its C++ kernels compiled in),
installed into a fresh, read-only venv, serving through its console script without compiling;
and the thin client without torch."""
from __future__ import annotations

import json
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
import time
import venv
import zipfile
from pathlib import Path

import openai
import pytest

from tests.server_harness import ServerProcess, free_port, need, poll

ROOT = Path(__file__).resolve().parents[2]


def _no_torch_after(code: str, python: str = sys.executable, cwd: Path = ROOT) -> None:
    check = f"{code}\nimport sys\nheavy = sorted({{'torch', 'transformers'}} & set(sys.modules))\n" \
            "assert not heavy, f'imported {heavy}'\n"
    proc = subprocess.run([python, "-c", check], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_thin_client_imports_neither_torch_nor_transformers() -> None:
    _no_torch_after("import service.grpc.minivllm_client")
    # The CLI's client commands too: `info` against nothing fails fast, with one line.
    _no_torch_after("from minivllm.cli import main\ntry:\n    main(['info', '--target', '127.0.0.1:9', "
                    "'--timeout', '2'])\nexcept SystemExit as exc:\n    assert exc.code == 1, exc.code\n"
                    "else:\n    raise AssertionError('info against nothing did not exit')")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Compiles the C++ kernels: minutes on a small, busy machine.
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = out.glob("minivllm-*.whl")
    return path


def test_wheel_carries_generated_grpc_code_and_kernel_source(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in ("service/pb/inference_pb2.py", "service/pb/inference_pb2_grpc.py", "service/pb/inference_pb2.pyi",
                 "engine/execution/kernels/paged_attention.cpp", "minivllm/cli.py"):
        assert name in names, f"{name} missing from {wheel.name}"
    assert not any(n.startswith("tests/") for n in names)


def test_wheel_carries_the_kernels_compiled_for_any_cpu_of_its_kind(wheel: Path) -> None:
    """The compiled kernels (a platform wheel), with the record the loader checks: one portable
    binary, its wide paths chosen at run time, never built for the build machine's CPU."""
    archive = zipfile.ZipFile(wheel)
    names = set(archive.namelist())
    assert [n for n in names if n.startswith("engine/execution/kernels/_minivllm_cpu_kernels.")
            and n.endswith(".so")], f"no compiled kernels in {wheel.name}"
    assert not wheel.name.endswith("-none-any.whl"), wheel.name
    info = json.loads(archive.read("engine/execution/kernels/_minivllm_cpu_kernels.json"))
    import torch

    assert info["torch"] == torch.__version__
    assert not any(flag.startswith(("-march=native", "-mtune=native")) for flag in info["cflags"]), info
    if platform.machine() != "x86_64":
        pytest.skip("the baseline check reads x86-64 instructions")
    need("objdump")
    # Beyond the x86-64-v2 baseline (VEX/EVEX: AVX and up; AMX) only in the kernels' own functions, the
    # ones with target attributes that best_isa() dispatches to: none in what an import runs (module
    # init, static initializers) nor in torch's or pybind11's inline code.
    (so,) = [n for n in names if n.endswith(".so")]
    path = Path(archive.extract(so, wheel.parent / "unpacked"))
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", str(path)], capture_output=True, text=True,
                             timeout=300, check=True).stdout
    wide, function = set(), None
    for line in listing.splitlines():
        if line.endswith(">:"):
            function = line.split("<", 1)[1][:-2]
        elif function is not None and re.match(r"\s+[0-9a-f]+:\s+(v|k[a-z]|tile|ldtilecfg|tdp)", line):
            wide.add(function)
    assert wide, "no AVX-512/AVX2 paths compiled in"
    assert all("minivllm::" in f and not f.startswith(("_GLOBAL__", "PyInit")) for f in wide), \
        sorted(f for f in wide if "minivllm::" not in f)


def _expected_best_isa() -> str:
    """The widest path the kernels' best_isa() should find here, read from /proc/cpuinfo: the shipped
    build must have every path this CPU can run (AVX512-BF16 and AMX included: a build without them
    would pass everything else, slower)."""
    flags = set(Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0].split())
    if {"avx512f", "avx512bw"} <= flags:
        return "amx" if {"amx_bf16", "amx_tile"} <= flags else "avx512_bf16" if "avx512_bf16" in flags else "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "scalar"


def test_wheel_in_a_fresh_read_only_venv_serves_grpc_and_openai(wheel: Path, tiny_model_dir: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONPATH", raising=False)  # the venv's processes see the wheel, not a checkout
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    # The dependencies come from this venv's site-packages (no download; a .pth line adds a
    # directory without running its .pth files, so this tree's editable install stays out).
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q",
                           str(wheel)], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and "no such option: --python" in proc.stderr:
        pytest.skip("pip too old for --python")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for path in [site, *site.rglob("*")]:  # read-only, as a system install would be
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    # An empty cache: the kernels' JIT build (a source install's) would go there and take minutes.
    cache = tmp_path / "cache"
    env = {"PYTHONDONTWRITEBYTECODE": "1", "MINIVLLM_CACHE": str(cache)}
    try:
        outside = tmp_path / "elsewhere"  # not the source tree: imports must come from the wheel
        outside.mkdir()
        where = subprocess.check_output([python, "-c", "import service.pb.inference_pb2 as m, engine.execution.kernels as k; "
                                         "print(m.__file__); print(k.__file__)"], cwd=outside, text=True)
        assert all(line.startswith(str(site)) for line in where.split()), where
        _no_torch_after("import service.grpc.minivllm_client", python=str(python), cwd=outside)
        # The shipped kernels load, with every path this CPU has.
        loaded = subprocess.run([python, "-c", "from engine.execution.kernels import ISAS, load_cpu_kernels; "
                                 "k = load_cpu_kernels(); print(k.__name__, {v: n for n, v in ISAS.items()}[k.best_isa()])"],
                                cwd=outside, env=dict(os.environ, **env), capture_output=True, text=True, timeout=120)
        assert loaded.returncode == 0, loaded.stdout + loaded.stderr
        assert loaded.stdout.split() == ["engine.execution.kernels._minivllm_cpu_kernels", _expected_best_isa()], \
            loaded.stdout + loaded.stderr
        http_port = free_port()
        start = time.monotonic()
        server = ServerProcess(tiny_model_dir, "--http-port", str(http_port), "--served-model-name", "tiny",
                               "--num-kv-blocks", "128", command=[str(env_dir / "bin" / "minivllm")], cwd=outside,
                               env=env)
        try:
            # Serving in seconds: nothing compiles (a JIT build here takes minutes and logs that it does).
            assert poll(lambda: "model tiny loaded" in server.output or "loaded; serving" in server.output, 120), \
                server.output
            print(f"wheel install: serving {time.monotonic() - start:.1f} s after start")
            assert "compiling the C++ kernels" not in server.output and "C++ CPU kernels unavailable" not in server.output, \
                server.output
            assert not (cache / "torch_extensions").exists(), list((cache / "torch_extensions").iterdir())
            info = subprocess.run([str(env_dir / "bin" / "minivllm"), "info", "--json", "--target", server.target],
                                  capture_output=True, text=True, timeout=60, cwd=outside)
            assert info.returncode == 0 and '"max_model_len"' in info.stdout, info.stdout + info.stderr
            with openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="x", max_retries=0) as client:
                chunks = list(client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
            assert chunks[-1].usage.completion_tokens == 5
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finally:
            server.close()
        assert "Traceback" not in server.output, server.output
    finally:
        for path in [site, *site.rglob("*")]:
            path.chmod(path.stat().st_mode | stat.S_IWUSR)
        shutil.rmtree(env_dir, ignore_errors=True)
