"""KV-cache groups end to end: sliding-window layers give back their out-of-window blocks, other
sequences reuse them, and every output stays token-exact (greedy) against the same model with
one group (every layer keeping every block), on every decode path; prefix hits over window
groups are exact too."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.tiny_model import build_tiny_family_model, family_config

NUM_NEW = 40
PARAMS = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen2-sliding", "mistral-window"])
def windowed_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """qwen2-sliding: layer 0 full, layer 1 window 8 (two groups); mistral-window: both layers
    window 8 (one window group)."""
    path = build_tiny_family_model(tmp_path_factory.mktemp(request.param) / "model", family_config(request.param))
    return request.param, path


def _prompts() -> list[list[int]]:
    return [[(7 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((200, 90, 33))]


@pytest.fixture(scope="module")
def one_group_reference(windowed_model: tuple[str, Path]) -> list[list[int]]:
    """Each prompt alone through one group of every layer (the cache before groups existed)."""
    llm = LLM(str(windowed_model[1]), num_kv_blocks=256, block_size=4, enable_hybrid_kv_cache=False,
              enable_prefix_caching=False)
    assert llm.engine.runner.kv_layout.windows == (None,)
    return [out.token_ids for out in llm.generate(_prompts(), PARAMS)]


@pytest.mark.parametrize("decode_path", ["fused", "cpp", "torch"])
def test_released_window_blocks_are_reused_and_the_output_stays_exact(
        windowed_model: tuple[str, Path], one_group_reference: list[list[int]], decode_path: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    family, path = windowed_model
    if decode_path == "torch":
        monkeypatch.setenv("MINIVLLM_DISABLE_CPP_KERNELS", "1")
    # The 200-token prompt alone needs 60 blocks of 4 per group by its end (240 tokens); in a
    # pool of 80 its window group fits only by handing blocks back (each sequence alone: no
    # preemption), and the prompts after it get blocks the window gave back.
    llm = LLM(str(path), num_kv_blocks=80, block_size=4, max_num_batched_tokens=32, max_num_seqs=1,
              max_fused_tokens=0 if decode_path != "fused" else 16)
    layout = llm.engine.runner.kv_layout
    assert layout.windows == ((None, 8) if family == "qwen2-sliding" else (8,))
    bm = llm.engine.block_manager
    outs = llm.generate(_prompts(), PARAMS)
    assert [o.token_ids for o in outs] == one_group_reference, family
    assert all(o.metrics.num_preemptions == 0 for o in outs)
    assert bm.num_used_blocks == 0 and bm.count_referenced_blocks() == 0


def test_concurrent_sequences_with_preemption_stay_exact(windowed_model: tuple[str, Path],
                                                          one_group_reference: list[list[int]]) -> None:
    """Several sequences at once in a pool too small for all: preempted and recomputed, their
    window blocks released and taken by the others; nothing leaks."""
    llm = LLM(str(windowed_model[1]), num_kv_blocks=90, block_size=4, max_num_batched_tokens=24)
    outs = llm.generate(_prompts(), PARAMS)
    assert [o.token_ids for o in outs] == one_group_reference
    assert llm.engine.block_manager.num_used_blocks == 0


def test_a_prefix_hit_over_window_groups_is_exact(windowed_model: tuple[str, Path]) -> None:
    """A prompt that shares a long prefix with an earlier one gets a hit (the window group takes
    only the blocks its window reaches) and generates what a cold engine does."""
    family, path = windowed_model
    first = _prompts()[0]
    second = first[:150] + [9, 8, 7, 6, 5]
    warm = LLM(str(path), num_kv_blocks=200, block_size=4, max_num_batched_tokens=64)
    warm.generate([first], PARAMS)
    hit = warm.generate([second], PARAMS)[0]
    assert hit.metrics.num_cached_tokens == 148  # 37 whole blocks of the shared 150 tokens
    cold = LLM(str(path), num_kv_blocks=200, block_size=4, max_num_batched_tokens=64, enable_prefix_caching=False)
    assert hit.token_ids == cold.generate([second], PARAMS)[0].token_ids, family
    assert warm.engine.block_manager.num_used_blocks == 0
