"""`minivllm serve` flags and MINIVLLM_* environment variables become a typed EngineConfig."""
from __future__ import annotations

import argparse

import pytest

from minivllm.cli import add_engine_args, engine_config_from_args


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(argv)


def test_env_vars_arrive_typed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINIVLLM_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("MINIVLLM_MIN_PREFILL_SHARE", "0.5")
    monkeypatch.setenv("MINIVLLM_ENABLE_PREFIX_CACHING", "false")
    config = engine_config_from_args(_parse(["--block-size", "8"]))
    assert config.max_num_seqs == 7 and config.min_prefill_share == 0.5
    assert config.enable_prefix_caching is False and config.block_size == 8
    assert config.model is None and config.max_num_batched_tokens == 512  # untouched defaults


def test_flags_override_env_and_bad_values_name_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINIVLLM_MAX_NUM_SEQS", "7")
    assert engine_config_from_args(_parse(["--max-num-seqs", "3"])).max_num_seqs == 3
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine_config_from_args(_parse(["--max-num-seqs", "0"]))
