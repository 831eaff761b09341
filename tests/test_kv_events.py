"""Prefix-cache events (what a cache-aware gateway indexes): replaying them gives exactly the
blocks the cache holds, with their tokens and chain; reset_prefix_cache drops it all, never
while a block is in use."""
from __future__ import annotations

from hypothesis import given, settings

from engine import LLM, AllBlocksCleared, BlockRemoved, BlockStored, KvCacheEvent, SamplingParams
from engine.core.block_manager import BlockManager, hash_block
from tests.block_ops import block_op_lists, run_block_ops
from tests.helpers import fake_seq


class CacheIndex:
    """What a subscriber knows from the events alone: hash -> (parent hash, tokens)."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}

    def apply(self, events: list[KvCacheEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                parent = event.parent_block_hash
                bs = event.block_size
                for i, block_hash in enumerate(event.block_hashes):
                    assert block_hash not in self.blocks, "stored twice without a removal"
                    self.blocks[block_hash] = (parent, event.token_ids[i * bs:(i + 1) * bs])
                    parent = block_hash
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    del self.blocks[block_hash]  # KeyError: removed something never stored
            else:
                assert isinstance(event, AllBlocksCleared)
                self.blocks.clear()


@settings(max_examples=120, deadline=None)
@given(block_op_lists(["add", "grow", "free", "flush"], max_slot=5, max_tokens=30, max_ops=50))
def test_events_replay_to_exactly_the_cached_blocks(ops: list[tuple[str, int, int]]) -> None:
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    index = CacheIndex()

    def prompt_tokens(slot: int, n: int) -> list[int]:  # prefixes shared, odd slots' parting after 7 tokens
        return [1 + (i % 3) + (slot % 2) * (i > 6) for i in range(n)]

    for op, live in run_block_ops(bm, ops, prompt_tokens):
        if op == "flush":
            assert bm.reset_prefix_cache() == (not live)
        index.apply(bm.take_events())
        assert set(index.blocks) == bm.cached_block_hashes()
        for block_hash, (parent, tokens) in index.blocks.items():
            assert len(tokens) == 4 and hash_block(parent or 0, list(tokens)) == block_hash
    assert bm.take_events() == []


def test_reset_prefix_cache_refuses_in_use_and_forgets_everything() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = fake_seq("a", 9)
    bm.allocate(a, 9, is_new=True)
    a.num_computed_tokens = 9
    bm.register_computed_blocks(a)
    stored = bm.take_events()
    assert stored == [BlockStored(tuple(a.block_hashes[:2]), None, tuple(range(1, 9)), 4)]
    assert not bm.reset_prefix_cache() and bm.take_events() == []  # a holds blocks
    bm.free(a)
    assert bm.reset_prefix_cache() and bm.take_events() == [AllBlocksCleared()]
    assert bm.cached_block_hashes() == set()
    b = fake_seq("b", 9)
    assert bm.allocate_cached_prefix(b) == 0  # nothing revivable after the flush


def test_engine_step_hands_out_the_events(tiny_llm: LLM) -> None:
    engine = tiny_llm.engine
    assert engine.reset_prefix_cache()
    engine.subscribe_kv_events()  # events are recorded only while someone subscribes
    engine.take_kv_events()
    prompt = list(range(3, 3 + 4 * 6 + 1))  # six full blocks of 4 and one token
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=2))
    events: list[KvCacheEvent] = []
    while engine.has_unfinished_requests():
        events += engine.step()[1].kv_events
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [t for e in stored for t in e.token_ids][:24] == prompt[:24]
    assert stored[0].parent_block_hash is None
    index = CacheIndex()
    index.apply(events)
    assert set(index.blocks) == engine.block_manager.cached_block_hashes()
    engine.unsubscribe_kv_events()
