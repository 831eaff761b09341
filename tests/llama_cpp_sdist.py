"""llama-cpp-python's source distribution, fetched from PyPI once and unpacked under the
project's cache: its vendored llama.cpp holds the official chat templates of many models
(vendor/llama.cpp/models/templates/) and the GGUF converter. Tests read them from here so no
template text is committed.

Without PyPI (an offline machine) a test that needs it is skipped, saying why; in CI it fails.
"""
from __future__ import annotations

import tarfile
from pathlib import Path

from engine.config import default_cache_dir
from tests.pypi_download import download_once

VERSION = "0.3.36"
_PACKAGE = f"llama-cpp-python=={VERSION}"
_DIR_NAME = f"llama_cpp_python-{VERSION}"
TEMPLATES = Path("vendor/llama.cpp/models/templates")  # in the unpacked directory


def llama_cpp_sdist() -> Path:
    """The unpacked sdist's directory (downloaded and unpacked on first use; later calls and runs
    reuse the cache). Skips the calling test when PyPI cannot be reached outside CI."""
    root = default_cache_dir() / "llama-cpp-python-sdist"
    target = root / _DIR_NAME
    if (target / "PKG-INFO").exists():
        return target

    def place(archive: Path, tmp: Path) -> None:
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        try:
            (tmp / _DIR_NAME).rename(target)  # whole or not at all
        except OSError:  # another process unpacked it meanwhile
            if not (target / "PKG-INFO").exists():
                raise

    download_once(root, _PACKAGE, "its chat templates and GGUF converter", ["--no-binary", ":all:"], place)
    return target


def chat_template(name: str) -> str:
    """The text of models/templates/<name>.jinja (e.g. "Qwen-Qwen3-0.6B")."""
    path = llama_cpp_sdist() / TEMPLATES / f"{name}.jinja"
    if not path.exists():
        names = sorted(p.stem for p in (llama_cpp_sdist() / TEMPLATES).glob("*.jinja"))
        raise FileNotFoundError(f"{path} is not in the sdist; it has {', '.join(names)}")
    return path.read_text(encoding="utf-8")

