"""Fixtures of the service tests: the tiny tool model's servers (tools; a reasoning parser),
one per test module that asks."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import EngineConfig
from tests.server_harness import ServerThread
from tests.service.tool_cases import END_THINK, THINK, TOOL_CALL_TOKEN, start_server


@pytest.fixture(scope="module")
def tool_server(tiny_tool_model_dir: Path) -> Iterator[ServerThread]:
    srv = start_server(tiny_tool_model_dir)
    assert srv.engine.tokenizer.convert_tokens_to_ids("<tool_call>") == TOOL_CALL_TOKEN
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reasoning_server(request: pytest.FixtureRequest, tiny_tool_model_dir: Path) -> Iterator[ServerThread]:
    """The tiny tool model's server with a reasoning parser: deepseek_r1 unless a test names
    another (`@pytest.mark.parametrize("reasoning_server", [name], indirect=True)`)."""
    parser = getattr(request, "param", "deepseek_r1")
    srv = ServerThread(EngineConfig(model=str(tiny_tool_model_dir), num_kv_blocks=512, block_size=4), http_port=0,
                       served_model_name="tiny", reasoning_parser=parser)
    tokenizer = srv.engine.tokenizer
    assert tokenizer.convert_tokens_to_ids(["<think>", "</think>"]) == [THINK, END_THINK]
    yield srv
    srv.stop()

