"""KV-cache groups: which layers share tables, and the block accounting of window groups (blocks
before the window released and reused, prefix hits only as long as every group can supply)."""
from __future__ import annotations

from hypothesis import given, settings

from engine.core.block_manager import BlockManager
from engine.execution.kv_cache_layout import KVCacheLayout
from tests.block_ops import block_op_lists, run_block_ops
from tests.helpers import fake_seq

# Gemma-3-1B's layers: five sliding (window 512) to one global, 26 in all.
GEMMA3_1B_WINDOWS = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(26))


def _check(bm: BlockManager) -> None:
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    assert bm.count_referenced_blocks() == bm.num_used_blocks


def _run(bm: BlockManager, seq, num_tokens: int, chunk: int) -> None:
    """Compute seq's first num_tokens tokens in chunks, as the scheduler would."""
    while seq.num_computed_tokens < num_tokens:
        n = min(chunk, num_tokens - seq.num_computed_tokens)
        assert bm.allocate(seq, n)
        seq.num_computed_tokens += n
        bm.register_computed_blocks(seq)


def test_layout_groups_layers_by_kind_in_groups_of_the_fewest() -> None:
    layout = KVCacheLayout.of(GEMMA3_1B_WINDOWS)
    assert layout.group_size == 4 and layout.windows == (None,) + (512,) * 6
    assert layout.groups[0].layers == (5, 11, 17, 23)
    assert [len(g.layers) for g in layout.groups[1:]] == [4, 4, 4, 4, 4, 2]  # 22 sliding: the last padded
    # Every layer in exactly one group, at a distinct tensor within it.
    for g, group in enumerate(layout.groups):
        assert [layout.layer_group[i] for i in group.layers] == [g] * len(group.layers)
        assert [layout.layer_slot[i] for i in group.layers] == list(range(len(group.layers)))
    assert layout.has_null_block


def test_one_kind_of_layer_is_one_group_as_before() -> None:
    full = KVCacheLayout.of((None,) * 30)
    assert full.num_groups == 1 and full.group_size == 30 and full.layer_slot == tuple(range(30))
    assert not full.has_null_block
    windowed = KVCacheLayout.of((8, 8))  # Mistral: one window group, which releases blocks
    assert windowed.windows == (8,) and windowed.has_null_block
    off = KVCacheLayout.of(GEMMA3_1B_WINDOWS, is_hybrid=False)
    assert off.windows == (None,) and off.group_size == 26
    covering = KVCacheLayout.of((None, 4096), max_model_len=2048)  # the window covers every context
    assert covering.windows == (None,)


def test_a_window_group_releases_blocks_before_its_window_and_they_are_reused() -> None:
    bm = BlockManager(num_blocks=40, block_size=4, windows=(None, 8))
    a = fake_seq("a", 64)
    held_by_a: set[int] = set()
    while a.num_computed_tokens < 64:
        assert bm.allocate(a, 8)
        a.num_computed_tokens += 8
        bm.register_computed_blocks(a)
        held_by_a |= set(a.block_tables[1])
    full, window = a.block_tables
    assert len(full) == len(window) == 16
    # The last chunk's first query (position 56) saw keys 49..56: blocks from 12 on were kept.
    assert window[:12] == [bm.null_block] * 12 and bm.null_block not in window[12:]
    assert bm.num_used_blocks == 16 + 4
    a.output_token_ids.append(5)
    assert bm.allocate(a, 1)  # a decode at position 64 sees keys 57..64: blocks 14 on
    assert a.block_tables[1][:14] == [bm.null_block] * 14 and bm.num_used_blocks == 17 + 3
    _check(bm)
    # Without releases the pool (40) could not hold a's 17 + 17 blocks and b's 8 + 8: the
    # released ones went back and are handed out again.
    b = fake_seq("b", 32)
    b.prompt_token_ids = [t + 1000 for t in b.prompt_token_ids]
    _run(bm, b, 32, chunk=8)
    assert bm.num_used_blocks == 20 + 8 + 4
    assert {blk for table in b.block_tables for blk in table} & (held_by_a - {bm.null_block} - set(a.block_tables[1]))
    _check(bm)
    bm.free(a)
    bm.free(b)
    assert bm.num_used_blocks == 0
    _check(bm)


def test_a_16k_gemma3_context_holds_a_fraction_of_a_full_caches_blocks() -> None:
    """Per group_size-layer block: the full group keeps all 1024 blocks of 16 tokens, each window
    group those its window and the last chunk reach."""
    layout = KVCacheLayout.of(GEMMA3_1B_WINDOWS)
    bm = BlockManager(num_blocks=4000, block_size=16, windows=layout.windows)
    seq = fake_seq("a", 16384)
    _run(bm, seq, 16384, chunk=512)
    seq.output_token_ids.append(5)
    assert bm.allocate(seq, 1)  # decoding at position 16384
    held = [sum(b != bm.null_block for b in table) for table in seq.block_tables]
    assert held == [1025] + [512 // 16 + 1] * 6
    hybrid_layer_blocks = bm.num_used_blocks * layout.group_size
    full_layer_blocks = 1025 * len(GEMMA3_1B_WINDOWS)
    assert hybrid_layer_blocks < 0.2 * full_layer_blocks


def test_a_prefix_hit_takes_only_the_window_blocks_and_leaves_null_before() -> None:
    bm = BlockManager(num_blocks=64, block_size=4, windows=(None, 8))
    a = fake_seq("a", 40)
    _run(bm, a, 40, chunk=40)
    bm.free(a)
    b = fake_seq("b", 41)  # a's tokens and one more
    assert bm.allocate_cached_prefix(b) == 40
    full, window = b.block_tables
    assert len(full) == len(window) == 10 and bm.null_block not in full
    # The next query (position 40) sees keys 33..40: blocks 8 and 9.
    assert window[:8] == [bm.null_block] * 8 and bm.null_block not in window[8:]
    assert bm.num_used_blocks == 12
    _check(bm)
    bm.free(b)
    _check(bm)
    assert bm.num_used_blocks == 0


def test_a_prefix_hit_is_only_as_long_as_the_window_group_can_supply() -> None:
    """A running sequence keeps its full-group blocks but released its early window blocks; once
    those are evicted, a prompt sharing only that early part gets no hit (a full cache would)."""
    bm = BlockManager(num_blocks=30, block_size=4, windows=(None, 8))
    a = fake_seq("a", 40)
    _run(bm, a, 40, chunk=8)  # holds 10 full + 4 window blocks; 6 window blocks released, published
    filler = fake_seq("f", 72)
    filler.prompt_token_ids = [t + 1000 for t in filler.prompt_token_ids]
    assert bm.allocate(filler, 4 * (bm.num_free_blocks // 2))  # takes every free block: evicts them
    bm.free(filler)
    b = fake_seq("b", 17)  # a's first 16 tokens and one more
    assert bm.allocate_cached_prefix(b) == 0
    assert b.block_tables == [[], []] and bm.num_used_blocks == 14
    single = BlockManager(num_blocks=30, block_size=4)  # the same with one full group: a hit
    a1 = fake_seq("a", 40)
    _run(single, a1, 40, chunk=8)
    assert single.allocate_cached_prefix(fake_seq("b", 17)) == 16


def test_a_hit_takes_the_window_blocks_of_a_window_not_a_multiple_of_the_block() -> None:
    bm = BlockManager(num_blocks=40, block_size=4, windows=(None, 5))
    a = fake_seq("a", 48)
    _run(bm, a, 48, chunk=48)  # whole: every window block published before any release
    bm.free(a)
    held_before = bm.num_used_blocks
    b = fake_seq("b", 60)  # a's 48 tokens, then others
    b.prompt_token_ids[48:] = [t + 1000 for t in b.prompt_token_ids[48:]]
    assert bm.allocate_cached_prefix(b) == 48
    # Position 48's window: keys 44..48, block 11 only (a window of 5 within blocks of 4).
    assert b.block_tables[1][:11] == [bm.null_block] * 11 and b.block_tables[1][11] != bm.null_block
    assert bm.num_used_blocks == held_before + 12 + 1
    bm.free(b)
    _check(bm)


def _shared_prefixes(slot: int, n: int) -> list[int]:
    return [1 + (i % 3) for i in range(n)]


@settings(max_examples=150, deadline=None)
@given(block_op_lists(["add", "grow", "free"], max_slot=7, max_tokens=40, max_ops=60))
def test_block_invariants_with_window_groups_under_random_ops(ops: list[tuple[str, int, int]]) -> None:
    """Accounting stays exact, every table covers its tokens, a window table holds real blocks
    exactly from the next query's window on, and nothing leaks."""
    bm = BlockManager(num_blocks=40, block_size=4, enable_prefix_caching=True, windows=(None, 6, 6))
    live = {}
    for _, live in run_block_ops(bm, ops, _shared_prefixes):
        _check(bm)
        for seq in live.values():
            for table, window in zip(seq.block_tables, bm.windows, strict=True):
                assert len(table) == bm.num_blocks_needed(seq.num_computed_tokens)
                released = bm.num_released_blocks(seq.num_computed_tokens, window)
                # released lazily (at the next allocation): never more than the window allows
                assert bm.null_block not in table[released:]
    for seq in live.values():
        bm.free(seq)
    _check(bm)
    assert bm.num_free_blocks == bm.num_blocks
