"""Optional C++ CPU kernels, compiled once on first use (torch.utils.cpp_extension).

If the compiler or headers are missing the engine falls back to the pure-torch path, which
gives the same results a little slower. MINIVLLM_DISABLE_CPP_KERNELS=1 (read by the model
runner, per engine) forces the fallback.
"""
from __future__ import annotations

import functools
import hashlib
import logging
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


_SOURCES = ("bindings.cpp", "paged_attention.cpp", "prefill_attention.cpp", "packed_gemm.cpp", "decode_layer.cpp",
            "token_bitmask.cpp")
_STALE_LOCK_S = 300  # a build takes up to 2 minutes on a busy 2-core machine; an older lock is from a killed process


def _remove_stale_lock(lock: Path) -> None:
    """torch waits forever on the lock of a build whose process was killed (a container stopped
    during its first start): without this, every later start would hang."""
    try:
        if time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            logger.warning("removing a stale kernel build lock %s", lock)
            lock.unlink()
    except FileNotFoundError:
        pass


@functools.cache
def load_cpu_kernels() -> ModuleType | None:
    try:
        import torch
        from torch.utils import cpp_extension

        from engine.model_loader import cache_dir

        here = Path(__file__).parent
        # One build per CPU kind and per install (where the sources are, which torch): builds of
        # one directory from two installs (a checkout and a wheel in a venv) rewrite each other's
        # ninja commands and rebuild in turn (about 2 minutes each here), and every server
        # started meanwhile waits on the build lock.
        install = hashlib.sha256(f"{here.resolve()}|{torch.__version__}".encode()).hexdigest()[:8]
        build_dir = cache_dir() / "torch_extensions" / f"{cpu_tag()}-{install}"
        build_dir.mkdir(parents=True, exist_ok=True)
        _remove_stale_lock(build_dir / "lock")
        return cpp_extension.load(
            name="minivllm_cpu_kernels", sources=[str(here / name) for name in _SOURCES], build_directory=str(build_dir),
            extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the torch path
        logger.warning("C++ CPU kernels unavailable (%s); using the pure-torch attention path", exc)
        return None
