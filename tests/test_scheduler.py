"""schedule() as a pure decision on fabricated sequences."""
from __future__ import annotations

from engine import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence, SequenceStatus
from tests.helpers import fake_seq, sampled


def _scheduler(budget: int = 32, max_seqs: int = 64, blocks: int = 256, share: float = 0.25,
               chunked: bool = True, aging_s: float = 5.0, **time_budget: object) -> Scheduler:
    """The token-budget policy unless time_budget options (enable_time_budget=True, ...) are given."""
    bm = BlockManager(blocks, 4, enable_prefix_caching=False)
    options = {"enable_time_budget": False} | time_budget
    return Scheduler(EngineConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                  enable_chunked_prefill=chunked, min_prefill_share=share, aging_s=aging_s,
                                  **options), bm)


def _running_decode(sched: Scheduler, rid: str, prompt: int = 6, arrival: float = 0.0) -> Sequence:
    """A sequence that finished prefill and sampled one token: next it decodes."""
    seq = fake_seq(rid, prompt, num_output=1, arrival=arrival)
    assert sched.block_manager.allocate(seq, prompt)
    seq.num_computed_tokens = prompt
    seq.status = SequenceStatus.RUNNING
    sched.running.append(seq)
    return seq


def test_decodes_first_then_prefill_within_budget() -> None:
    sched = _scheduler(budget=32, share=0.0)
    decodes = [_running_decode(sched, f"d{i}") for i in range(10)]
    sched.add(fake_seq("p", 50, arrival=1.0))
    out = sched.schedule(now=2.0)
    assert out.decode_req_ids == [d.request_id for d in decodes]
    assert out.prefill_req_ids[0] == "p" and out.prefill_num_tokens == [22]  # chunk = what is left
    assert out.num_batched_tokens == 32


def test_budget_is_never_exceeded_and_chunks_cover_the_prompt() -> None:
    sched = _scheduler(budget=16)
    seq = fake_seq("long", 70)
    sched.add(seq)
    chunks = []
    while seq.num_output_tokens == 0:
        out = sched.schedule(now=0.0)
        assert out.num_batched_tokens <= 16
        chunks.extend(out.prefill_num_tokens)
        assert out.sampling_req_ids == ([seq.request_id] if out.prefill_is_last_chunk == [True] else [])
        sched.update_from_output(out, sampled(out), now=0.0)
    assert chunks == [16, 16, 16, 16, 6]
    assert seq.num_computed_tokens == 70 and seq.output_token_ids == [9] and seq.is_decode


def test_prefill_share_is_kept_while_requests_wait() -> None:
    sched = _scheduler(budget=32, share=0.25)
    for i in range(40):
        _running_decode(sched, f"d{i}")
    out = sched.schedule(now=0.0)
    assert len(out.decode_req_ids) == 32  # nobody waits: decodes may use the whole budget
    sched.add(fake_seq("new", 20, arrival=1.0))
    out = sched.schedule(now=1.0)
    assert len(out.decode_req_ids) == 24 and out.prefill_num_tokens == [8]
    assert out.num_batched_tokens == 32


def test_budget_limited_decodes_rotate() -> None:
    sched = _scheduler(budget=8, share=0.0)
    seqs = [_running_decode(sched, f"d{i}") for i in range(12)]
    first = sched.schedule(now=0.0).decode_req_ids
    second = sched.schedule(now=0.0).decode_req_ids
    assert first == [s.request_id for s in seqs[:8]]
    assert second[:4] == [s.request_id for s in seqs[8:]]  # the ones skipped last step go first


def test_aging_lets_an_old_low_priority_request_overtake() -> None:
    sched = _scheduler(budget=8, aging_s=5.0)
    old = fake_seq("old-low", 8, arrival=0.0, priority=2)
    new = fake_seq("new-high", 8, arrival=9.0, priority=0)
    sched.add(new)
    sched.add(old)
    # At t=9.5 old has waited 9.5 s: 2 - 1.9 = 0.1 > new's 0 - 0.1: new goes first.
    assert sched.schedule(now=9.5).prefill_req_ids[0] == new.request_id
    sched2 = _scheduler(budget=8, aging_s=5.0)
    old2, new2 = fake_seq("old-low", 8, arrival=0.0, priority=2), fake_seq("new-high", 8, arrival=14.0)
    sched2.add(new2)
    sched2.add(old2)
    # At t=15: old is at 2 - 3 = -1, new at -0.2: age wins.
    assert sched2.schedule(now=15.0).prefill_req_ids[0] == old2.request_id


def test_preemption_evicts_newest_and_requeues_it_first() -> None:
    sched = _scheduler(budget=64, blocks=5, share=0.0)
    # Each holds a full block of 4 prompt tokens + 1 output token: the decode needs a second block.
    seqs = [_running_decode(sched, f"d{i}", prompt=4, arrival=float(i)) for i in range(4)]
    bm = sched.block_manager
    assert bm.num_free_blocks == 1
    out = sched.schedule(now=10.0)
    assert out.decode_req_ids == ["d0", "d1"]
    assert out.preempted_req_ids == ["d3", "d2"]
    assert sched.waiting == [seqs[2], seqs[3]]  # the front of the queue, oldest first
    for s in (seqs[3], seqs[2]):
        assert s.status is SequenceStatus.WAITING and s.num_computed_tokens == 0 and not s.block_table
        assert s.output_token_ids == [7]  # tokens kept: recompute, not restart
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks


def test_head_of_line_is_not_skipped_when_blocks_are_short() -> None:
    sched = _scheduler(budget=64, blocks=4, share=0.0)
    sched.add(fake_seq("big", 30, arrival=0.0))
    sched.add(fake_seq("small", 2, arrival=1.0))
    out = sched.schedule(now=2.0)
    assert out.is_empty and [s.request_id for s in sched.waiting] == ["big", "small"]


def test_max_num_seqs_caps_the_batch() -> None:
    sched = _scheduler(budget=100, max_seqs=3)
    for i in range(5):
        sched.add(fake_seq(f"p{i}", 2, arrival=float(i)))
    out = sched.schedule(now=5.0)
    assert out.prefill_req_ids == ["p0", "p1", "p2"]


def test_without_chunking_a_long_prompt_runs_whole() -> None:
    sched = _scheduler(budget=16, chunked=False)
    sched.add(fake_seq("long", 40))
    sched.add(fake_seq("short", 3, arrival=1.0))
    out = sched.schedule(now=2.0)
    assert out.prefill_num_tokens == [40]


def test_the_step_names_requests_by_id_and_sends_the_runner_only_what_changed() -> None:
    """A request's row is sent once (new_requests), then only block-table changes; a finished
    one is removed at the next step; a preempted one is removed in the step that preempts it
    and later re-sent whole, with the tokens it had generated (recompute)."""
    sched = _scheduler(budget=64, blocks=5, share=0.0)
    a = fake_seq("a", 3, arrival=0.0)
    a.params.max_tokens = 3
    sched.add(a)
    out = sched.schedule(now=0.0)
    assert [n.req_id for n in out.new_requests] == ["a"] and out.new_requests[0].block_ids == a.block_table
    assert out.block_table_updates == {} and out.removed_req_ids == []
    sched.update_from_output(out, sampled(out), now=0.0)  # a: 3 prompt + 1 output token, one block of 4
    out = sched.schedule(now=0.0)  # its decode fills the block: no new block yet
    assert out.new_requests == [] and out.block_table_updates == {} and out.decode_req_ids == ["a"]
    sched.update_from_output(out, sampled(out), now=0.0)
    out = sched.schedule(now=0.0)  # the next token needs a second block: only that is sent
    assert out.new_requests == [] and out.block_table_updates == {"a": (1, [a.block_table[1]])}
    updates = sched.update_from_output(out, sampled(out), now=0.0)
    assert updates[0].finish_reason == "length"  # max_tokens=3
    out = sched.schedule(now=1.0)
    assert out.removed_req_ids == ["a"] and out.is_empty

    for i in range(3):  # three sequences of a block each on 5 blocks; their decodes need 3 more: preemption
        sched.add(fake_seq(f"d{i}", 4, arrival=float(i)))
    out = sched.schedule(now=2.0)
    sched.update_from_output(out, sampled(out), now=2.0)
    out = sched.schedule(now=2.0)
    assert out.preempted_req_ids == ["d2"] and "d2" not in out.decode_req_ids
    assert out.removed_req_ids == ["d2"]  # in the same step: its row goes at once
    for _ in range(20):
        resumed = [n for n in out.new_requests if n.req_id == "d2"]
        if resumed:
            break
        sched.update_from_output(out, sampled(out), now=2.0)
        out = sched.schedule(now=3.0)
    assert resumed and resumed[0].output_token_ids == [9]  # it comes back with its token
