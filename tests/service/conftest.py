"""Fixtures of the service tests: the tiny tool model's servers (tools; a reasoning parser),
one per test module that asks; gpt-oss's vocabulary, model directory and Harmony format."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import EngineConfig
from service.chat.harmony import HarmonyFormat
from tests.harmony_data import byte_level
from tests.o200k_vocab import o200k_ranked_tokens
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


@pytest.fixture(scope="module")
def ranked() -> list[bytes]:
    return o200k_ranked_tokens()


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory: pytest.TempPathFactory, ranked: list[bytes]) -> Path:
    """A gpt-oss model directory as far as the service reads one: config.json and a byte-level
    tokenizer.json with o200k's ranked tokens and Harmony's specials after them."""
    root = tmp_path_factory.mktemp("gpt_oss")
    vocab = {s: i for i, s in enumerate(byte_level(ranked))}
    vocab |= {"<|startoftext|>": 199998, "<|endoftext|>": 199999, "<|return|>": 200002, "<|call|>": 200012}
    (root / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab, "merges": []}}))
    (root / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    return root


@pytest.fixture(scope="module")
def harmony(gpt_oss_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HarmonyFormat]:
    with pytest.MonkeyPatch.context() as patch:  # loading points TIKTOKEN_ENCODINGS_BASE at its file
        patch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
        yield HarmonyFormat.load([gpt_oss_dir], cache_dir=tmp_path_factory.mktemp("cache"))
