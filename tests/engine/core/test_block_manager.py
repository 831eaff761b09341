"""Block accounting: free + used == total whatever happens, and nothing leaks."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.core.block_manager import BlockManager
from tests.block_ops import block_op_lists, run_block_ops
from tests.helpers import fake_seq


def _check(bm: BlockManager) -> None:
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    assert bm.count_referenced_blocks() == bm.num_used_blocks


def _shared_prefixes(slot: int, n: int) -> list[int]:
    """The same tokens for every sequence: prefixes shared across them."""
    return [1 + (i % 3) for i in range(n)]


@settings(max_examples=150, deadline=None)
@given(block_op_lists(["add", "grow", "free"], max_slot=7, max_tokens=40, max_ops=60))
def test_block_invariants_under_random_ops(ops: list[tuple[str, int, int]]) -> None:
    bm = BlockManager(num_blocks=24, block_size=4, enable_prefix_caching=True)
    live = {}  # the driver's, once it has run an op
    for _, live in run_block_ops(bm, ops, _shared_prefixes):
        _check(bm)
        for seq in live.values():
            assert len(seq.block_table) == bm.num_blocks_needed(seq.num_computed_tokens)
    for seq in live.values():
        bm.free(seq)
    _check(bm)
    assert bm.num_free_blocks == bm.num_blocks


def test_prefix_hit_shares_blocks_and_keeps_one_token_to_compute() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = fake_seq("a", 12)
    bm.allocate(a, 12, is_new=True)
    a.num_computed_tokens = 12
    bm.register_computed_blocks(a)
    b = fake_seq("b", 12)  # same tokens
    assert bm.allocate_cached_prefix(b) == 8  # not 12: the last token must run for logits
    assert b.block_table == a.block_table[:2]
    bm.free(a)
    assert bm.num_used_blocks == 2  # still referenced by b
    bm.free(b)
    assert bm.num_used_blocks == 0
    c = fake_seq("c", 10)
    assert bm.allocate_cached_prefix(c) == 8  # revived from the LRU free list


@settings(max_examples=12, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 60), st.integers(1, 12), st.booleans(), st.integers(0, 3)),
                min_size=1, max_size=10))
def test_engine_frees_every_block_after_any_mix(tiny_llm: LLM, reqs: list[tuple[int, int, bool, int]]) -> None:
    engine = tiny_llm.engine
    bm = engine.block_manager
    ids = []
    for i, (plen, max_tokens, greedy, _) in enumerate(reqs):
        prompt = [(i * 7 + j) % 300 + 3 for j in range(plen)]
        ids.append(engine.add_request(prompt, SamplingParams(temperature=0 if greedy else 1.0, max_tokens=max_tokens)))
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for i, (_, _, _, abort_at) in enumerate(reqs):
            if abort_at and step == abort_at:
                engine.abort_request(ids[i])
        engine.step()
        _check(bm)
    assert bm.num_used_blocks == 0


def test_forked_samples_share_the_partial_block_until_one_writes_into_it() -> None:
    """Copy-on-write at the first write: the writer gets a copy (handed out once by take_copies),
    the block stays with the others, and the last sharer writes in place."""
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    parent = fake_seq("p", 6)  # one full block and a partial one
    assert bm.allocate(parent, 6, is_new=True)
    parent.num_computed_tokens = 6
    parent.block_table_changed_from = None  # as if the runner had been told
    children = [fake_seq(f"p/{i}", 6) for i in (1, 2)]
    for child in children:
        bm.fork(parent, child)
        child.num_computed_tokens = 6
    assert all(c.block_table == parent.block_table for c in children) and bm.take_copies() == []
    shared = parent.block_table[-1]
    used = bm.num_used_blocks
    assert bm.allocate(parent, 1)  # the parent writes first: it copies
    assert parent.block_table[-1] != shared and bm.take_copies() == [(shared, parent.block_table[-1])]
    assert parent.block_table_changed_from == 1 and bm.num_used_blocks == used + 1
    assert bm.allocate(children[0], 1)  # still shared with children[1]: a copy
    assert bm.take_copies() == [(shared, children[0].block_table[-1])]
    assert bm.allocate(children[1], 1)  # the last sharer: in place, no copy
    assert children[1].block_table[-1] == shared and bm.take_copies() == []
    for seq in [parent, *children]:
        bm.free(seq)
    _check(bm)
    assert bm.num_used_blocks == 0
