"""Optional C++ CPU kernels: a wheel ships them compiled (setup.py: one portable binary whose SIMD path
is chosen at run time); a source or editable install compiles them once on first use
(torch.utils.cpp_extension, -march=native).

If the compiler or headers are missing the engine falls back to the pure-torch path, which
gives the same results a little slower. EngineConfig.enable_cpp_kernels=False (alias
MINIVLLM_DISABLE_CPP_KERNELS=1) forces the fallback.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import json
import logging
import os
import platform
import time
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)


def cpu_tag() -> str:
    """Identifies the CPU's instruction set: a -march=native build is only valid on its own kind."""
    info = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            info += "".join(line for line in f if line.startswith(("flags", "model name", "Features")))
    except OSError:
        pass
    return hashlib.sha256(info.encode()).hexdigest()[:12]


# The kernels' SIMD paths by name, as their `isa` argument takes them (cpu_kernels.h's kIsa*).
ISAS = {"scalar": 0, "avx2": 1, "avx512": 2, "avx512_bf16": 3, "amx": 4}

_SOURCES = ("bindings.cpp", "paged_attention.cpp", "prefill_attention.cpp", "packed_gemm.cpp", "decode_layer.cpp",
            "decode_model.cpp", "token_bitmask.cpp", "quant_gemm.cpp", "quant_tiles_avx512.cpp", "quant_tiles_avx2.cpp",
            "quant_tiles_amx.cpp",
            "linear_chain.cpp", "moe_experts.cpp", "encoder_parts.cpp", "scratch_pool.cpp")
_STALE_LOCK_S = 300  # longer than a build takes on a busy small machine: an older lock is from a killed process


def _remove_stale_lock(lock: Path) -> None:
    """torch waits forever on the lock of a build whose process was killed (a container stopped
    during its first start): without this, every later start would hang."""
    try:
        if time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            logger.warning("removing a stale kernel build lock %s", lock)
            lock.unlink()
    except FileNotFoundError:
        pass


def build_sources(root: Path, kernel_dir: Path, torch_dir: Path, torch_version: str) -> tuple[Path, Path]:
    """The build directory (under root) for the kernel sources in kernel_dir and this torch on this CPU kind, and the
    copy of the sources in it that the build reads.

    A build is named by what it builds, not by where it is installed: a checkout and a wheel in
    a venv with the same sources share one build. Both compile the copy, so their ninja commands
    are the same. Otherwise one build directory fed from two source paths rewrites its ninja
    commands on every load and rebuilds in turn (minutes each on a small machine); servers
    started meanwhile wait on the build lock. Sources that differ get their own directory."""
    files = sorted(p for p in kernel_dir.iterdir() if p.suffix in (".cpp", ".h"))
    digest = hashlib.sha256(f"{torch_dir.resolve()}|{torch_version}".encode())
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    build_dir = root / f"{cpu_tag()}-{digest.hexdigest()[:12]}"
    source_dir = build_dir / "src"
    source_dir.mkdir(parents=True, exist_ok=True)
    for path in files:
        copy = source_dir / path.name
        if not copy.exists():  # written once: a newer mtime would make ninja rebuild
            partial = copy.with_name(f"{copy.name}.{os.getpid()}.tmp")
            partial.write_bytes(path.read_bytes())
            os.replace(partial, copy)
    return build_dir, source_dir


def load_extension(name: str, kernel_dir: Path, sources: tuple[str, ...]) -> ModuleType:
    """Build (once per source digest, torch and CPU kind) and import the C++ extension `name`
    from kernel_dir's sources; raises on a build failure."""
    import torch
    from torch.utils import cpp_extension

    from engine.config import default_cache_dir

    build_dir, source_dir = build_sources(default_cache_dir() / "torch_extensions", kernel_dir,
                                          Path(torch.__file__).parent, torch.__version__)
    _remove_stale_lock(build_dir / "lock")
    # Built already (the directory is named by its sources, torch and CPU kind): load only, silently.
    compiling = not (build_dir / f"{name}.so").exists()
    if compiling:
        logger.warning("compiling the C++ kernels %s with -march=native into %s: once for these sources, this torch "
                       "and this CPU kind, a few minutes (a wheel ships them compiled)", name, build_dir)
    start = time.monotonic()
    module = cpp_extension.load(
        name=name, sources=[str(source_dir / source) for source in sources], build_directory=str(build_dir),
        extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    if compiling:
        logger.warning("compiled the C++ kernels %s in %.0f s", name, time.monotonic() - start)
    return module


# The kernels compiled into a wheel by setup.py, with <name>.json beside them: the torch they link
# against and the digest of the sources they were built from.
_SHIPPED = "_minivllm_cpu_kernels"


def sources_digest(kernel_dir: Path) -> str:
    """The kernel sources' digest, as setup.py's kernel_sources_digest records it."""
    digest = hashlib.sha256()
    for path in sorted(p for p in kernel_dir.iterdir() if p.suffix in (".cpp", ".h")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def load_shipped_kernels(kernel_dir: Path) -> ModuleType | None:
    """The package's compiled kernels when it has them (a wheel) and they were built from these sources
    against this torch; None otherwise (a source or editable install: they compile on first use)."""
    try:
        info = json.loads((kernel_dir / f"{_SHIPPED}.json").read_text())
    except FileNotFoundError:
        return None
    import torch

    # A C++ extension links against one torch's C++ API: another build of torch may not load it, or crash.
    if (info["torch"], info["cxx11_abi"]) != (torch.__version__, bool(torch.compiled_with_cxx11_abi())):
        logger.warning("the C++ kernels in this package were built for torch %s, this is torch %s: compiling them "
                       "for it instead", info["torch"], torch.__version__)
        return None
    if info["sources"] != sources_digest(kernel_dir):
        logger.warning("the C++ kernel sources changed since this package's kernels were built: compiling them")
        return None
    return importlib.import_module(f"{__name__}.{_SHIPPED}")


@functools.cache
def load_cpu_kernels() -> ModuleType | None:
    kernel_dir = Path(__file__).parent
    try:
        shipped = load_shipped_kernels(kernel_dir)
    except Exception as exc:  # noqa: BLE001 - an unreadable record or an import failure: build them as a checkout does
        logger.warning("the C++ kernels in this package do not load (%s): compiling them", exc)
        shipped = None
    if shipped is not None:
        return shipped
    try:
        return load_extension("minivllm_cpu_kernels", kernel_dir, _SOURCES)
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the torch path
        logger.warning("C++ CPU kernels unavailable (%s); using the pure-torch attention path", exc)
        return None
