"""Prefix-cache events are recorded only while someone subscribes: with no subscriber a block
store, an eviction or a flush records nothing (nothing accumulates), and a subscriber that comes
later sees, from then on, exactly the events an engine recording all along would have shown."""
from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from engine import LLM, BlockStored, EngineConfig, KvCacheEvent, SamplingParams
from engine.core.block_manager import BlockManager
from tests.block_ops import block_op_lists, run_block_ops
from tests.helpers import fake_seq
from tests.server_harness import ServerThread

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
