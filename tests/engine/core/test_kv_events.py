"""Prefix-cache events (what a cache-aware gateway indexes): replaying them gives exactly the
blocks the cache holds, with their tokens and chain; reset_prefix_cache drops it all, never
while a block is in use.

Prefix-cache events are recorded only while someone subscribes: with no subscriber a block
store, an eviction or a flush records nothing (nothing accumulates), and a subscriber that comes
later sees, from then on, exactly the events an engine recording all along would have shown.
"""
from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from engine import LLM, AllBlocksCleared, BlockRemoved, BlockStored, EngineConfig, KvCacheEvent, SamplingParams
from engine.core.block_manager import BlockManager, hash_block
from tests.block_ops import block_op_lists, run_block_ops
from tests.helpers import fake_seq
from tests.server_harness import ServerThread


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


Op = tuple[str, int, int]
ops_strategy = block_op_lists(["add", "grow", "free", "flush"], max_slot=5, max_tokens=30, max_ops=50)


def prompt_tokens(slot: int, n: int) -> list[int]:
    """Shared prefixes, and distinct tails (n varies them), so the pool of 16 fills with cached
    blocks and new ones evict them (BlockRemoved)."""
    return [1 + (i % 3) + (slot % 2) * (i > 6) + (n % 5) * (i > 10) for i in range(n)]


@settings(max_examples=150, deadline=None)
@given(ops_strategy, st.integers(0, 50), st.integers(0, 50))
def test_events_only_while_recording_and_equal_to_always_recording(ops: list[Op], start: int, length: int) -> None:
    """A twin that records all along is the reference: the switched one records nothing before
    `start` and after `start + length`, and between them exactly what the twin records."""
    always, switched = BlockManager(16, 4), BlockManager(16, 4, is_recording_events=False)
    switched.set_recording_events(start <= 0 < start + length)
    for i, ((op, _), _) in enumerate(zip(run_block_ops(always, ops, prompt_tokens),
                                         run_block_ops(switched, ops, prompt_tokens), strict=True)):
        if op == "flush":
            always.reset_prefix_cache()
            switched.reset_prefix_cache()
        expected = always.take_events()
        assert switched.take_events() == (expected if start <= i < start + length else [])
        assert switched.cached_block_hashes() == always.cached_block_hashes()
        switched.set_recording_events(start <= i + 1 < start + length)  # for the next op


def test_evictions_recorded_only_while_recording() -> None:
    for is_recording in (False, True):
        bm = BlockManager(4, 4, is_recording_events=is_recording)
        first, second = fake_seq("a", 9), fake_seq("b", 9)
        second.prompt_token_ids = [50 + i for i in range(9)]
        for seq in (first, second):  # the second takes the first's cached blocks: evicted
            assert bm.allocate(seq, 9, is_new=True)
            seq.num_computed_tokens = 9
            bm.register_computed_blocks(seq)
            bm.free(seq)
        kinds = [type(e).__name__ for e in bm.take_events()]
        assert kinds == (["BlockStored", "BlockRemoved", "BlockStored"] if is_recording else [])


def test_stopping_drops_events_not_taken() -> None:
    bm = BlockManager(8, 4)
    seq = fake_seq("a", 9)
    bm.allocate(seq, 9, is_new=True)
    seq.num_computed_tokens = 9
    bm.register_computed_blocks(seq)
    bm.set_recording_events(False)
    assert bm.take_events() == []
    bm.free(seq)
    assert bm.reset_prefix_cache() and bm.take_events() == []


def _generate(llm: LLM, prompt: list[int]) -> list[KvCacheEvent]:
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=3))
    events: list[KvCacheEvent] = []
    while engine.has_unfinished_requests():
        events += engine.step()[1].kv_events
    return events


def _stored_hashes(events: list[KvCacheEvent]) -> set[int]:
    return {h for e in events if isinstance(e, BlockStored) for h in e.block_hashes}


def test_engine_records_nothing_without_a_subscriber_and_a_late_one_sees_what_follows(tiny_llm: LLM) -> None:
    engine = tiny_llm.engine
    assert engine.reset_prefix_cache()
    engine.take_kv_events()
    # No subscriber: blocks are cached, yet no step hands out an event and none waits.
    assert _generate(tiny_llm, list(range(5, 5 + 4 * 5 + 1))) == []
    assert engine.take_kv_events() == []
    cached_before = engine.block_manager.cached_block_hashes()
    assert len(cached_before) >= 5
    engine.subscribe_kv_events()
    try:
        # A late subscriber: the blocks cached from now on (the new request's own; its shared
        # prefix was cached before and is not replayed), then the flush.
        events = _generate(tiny_llm, list(range(5, 5 + 4 * 2)) + list(range(90, 90 + 4 * 4 + 1)))
        cached_after = engine.block_manager.cached_block_hashes()
        assert _stored_hashes(events) == cached_after - cached_before and len(cached_after - cached_before) >= 4
        assert engine.reset_prefix_cache()
        assert [type(e).__name__ for e in engine.take_kv_events()] == ["AllBlocksCleared"]
    finally:
        engine.unsubscribe_kv_events()
    assert _generate(tiny_llm, list(range(200, 200 + 4 * 3 + 1))) == []
    assert engine.reset_prefix_cache() and engine.take_kv_events() == []


def test_two_subscribers_record_until_the_last_leaves(tiny_llm: LLM) -> None:
    engine = tiny_llm.engine
    assert engine.reset_prefix_cache()
    engine.subscribe_kv_events()
    engine.subscribe_kv_events()
    engine.unsubscribe_kv_events()
    assert _stored_hashes(_generate(tiny_llm, list(range(300, 300 + 4 * 3 + 1))))
    engine.unsubscribe_kv_events()
    assert _generate(tiny_llm, list(range(400, 400 + 4 * 3 + 1))) == []


def test_a_server_without_the_vllm_door_records_no_events(tiny_model_dir: Path) -> None:
    """Only the vLLM contract's SubscribeKvEvents reads the events; its test (test_vllm_grpc)
    shows a server with it records them from its start."""
    server = ServerThread(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, block_size=4),
                          grpc_services=("minivllm",))
    try:
        assert not server.engine.block_manager.is_recording_events
    finally:
        server.stop()
