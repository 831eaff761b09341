"""Shared fixtures: a tiny random model for unit tests, the real default model for a focused set."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from engine import LLM
from tests.tiny_model import build_tiny_model

logging.getLogger("engine").setLevel(logging.WARNING)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), num_kv_blocks=512, block_size=4, max_num_batched_tokens=64)


@pytest.fixture(scope="session")
def real_llm() -> LLM:
    return LLM(None, num_kv_blocks=512)
