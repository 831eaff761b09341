"""llama-cpp-python's source distribution, fetched from PyPI once and unpacked under the
project's cache: its vendored llama.cpp holds the official chat templates of many models
(vendor/llama.cpp/models/templates/) and the GGUF converter. Tests read them from here so no
template text is committed.

Without PyPI (an offline machine) a test that needs it is skipped, saying why; in CI it fails.
"""
from __future__ import annotations

import logging
import socket
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

from engine.config import default_cache_dir
from tests.server_harness import IN_CI

VERSION = "0.3.36"
_PACKAGE = f"llama-cpp-python=={VERSION}"
_DIR_NAME = f"llama_cpp_python-{VERSION}"
TEMPLATES = Path("vendor/llama.cpp/models/templates")  # in the unpacked directory

logger = logging.getLogger(__name__)


def _pypi_reachable() -> bool:
    try:
        with socket.create_connection(("pypi.org", 443), timeout=10):
            return True
    except OSError:
        return False


def llama_cpp_sdist() -> Path:
    """The unpacked sdist's directory (downloaded and unpacked on first use; later calls and runs
    reuse the cache). Skips the calling test when PyPI cannot be reached outside CI."""
    root = default_cache_dir() / "llama-cpp-python-sdist"
    target = root / _DIR_NAME
    if (target / "PKG-INFO").exists():
        return target
    if not _pypi_reachable():
        reason = f"PyPI is unreachable: cannot fetch {_PACKAGE}'s sdist (its chat templates)"
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        logger.info("downloading %s's sdist into %s (once)", _PACKAGE, root)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
                        "-d", tmp, _PACKAGE], check=True)
        archive = next(Path(tmp).glob("*.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        try:
            (Path(tmp) / _DIR_NAME).rename(target)  # whole or not at all
        except OSError:  # another process unpacked it meanwhile
            if not (target / "PKG-INFO").exists():
                raise
    return target


def chat_template(name: str) -> str:
    """The text of models/templates/<name>.jinja (e.g. "Qwen-Qwen3-0.6B")."""
    path = llama_cpp_sdist() / TEMPLATES / f"{name}.jinja"
    if not path.exists():
        names = sorted(p.stem for p in (llama_cpp_sdist() / TEMPLATES).glob("*.jinja"))
        raise FileNotFoundError(f"{path} is not in the sdist; it has {', '.join(names)}")
    return path.read_text(encoding="utf-8")

