"""schedule() as a pure decision on fabricated sequences.

Scheduling policies on the tiny model: each gives exactly the tokens of a run without it.
"""
from __future__ import annotations

from pathlib import Path

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.core.block_manager import BlockManager
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence, SequenceStatus
from tests.helpers import fake_seq, run_engine, sampled


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
    assert [n.req_id for n in out.new_requests] == ["a"] and out.new_requests[0].block_ids == [a.block_table]
    assert out.block_table_updates == {} and out.removed_req_ids == []
    sched.update_from_output(out, sampled(out), now=0.0)  # a: 3 prompt + 1 output token, one block of 4
    out = sched.schedule(now=0.0)  # its decode fills the block: no new block yet
    assert out.new_requests == [] and out.block_table_updates == {} and out.decode_req_ids == ["a"]
    sched.update_from_output(out, sampled(out), now=0.0)
    out = sched.schedule(now=0.0)  # the next token needs a second block: only that is sent
    assert out.new_requests == [] and out.block_table_updates == {"a": (1, [[a.block_table[1]]])}
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


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[(i * 13 + j * 7) % 400 + 3 for j in range(n)] for i, n in enumerate((5, 130, 41, 77, 9, 260))]


def _engine(model: Path, **kw: object) -> LLMEngine:
    # The token budget: chunk sizes then depend on the policy alone, not on measured step times,
    # so a failure here reproduces.
    base = dict(model=str(model), block_size=4, num_kv_blocks=1024, max_num_batched_tokens=4096,
                enable_prefix_caching=False, enable_time_budget=False)
    base.update(kw)
    return LLMEngine(EngineConfig(**base))


def _tokens(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    ids = [engine.add_request(p, params) for p in prompts]
    outputs, _ = run_engine(engine)
    assert engine.block_manager.num_used_blocks == 0
    return [outputs[i][-1].token_ids for i in ids]


def test_chunked_prefill_gives_the_same_tokens(tiny_model_dir: Path) -> None:
    reference = _tokens(_engine(tiny_model_dir), PROMPTS)
    chunked = _engine(tiny_model_dir, max_num_batched_tokens=32)
    assert _tokens(chunked, PROMPTS) == reference


def test_preemption_gives_the_same_tokens(tiny_model_dir: Path) -> None:
    reference = _tokens(_engine(tiny_model_dir), PROMPTS)
    # 120 blocks of 4 tokens cannot hold all six sequences as they grow: some get preempted
    # (with the token budget's schedule, which this setup was sized for).
    small = _engine(tiny_model_dir, num_kv_blocks=120, max_num_batched_tokens=64)
    preemptions = 0
    ids = [small.add_request(p, GREEDY) for p in PROMPTS]
    finals = {}
    while small.has_unfinished_requests():
        outputs, stats = small.step()
        preemptions += stats.num_preemptions
        finals.update({o.request_id: o for o in outputs if o.is_finished})
    assert preemptions > 0
    assert [finals[i].token_ids for i in ids] == reference
    assert sum(finals[i].metrics.num_preemptions for i in ids) == preemptions


def test_prefix_cache_hits_give_the_same_tokens(tiny_model_dir: Path) -> None:
    shared = [(j * 11) % 400 + 3 for j in range(64)]
    prompts = [shared + [5 + i, 6 + i, 7 + i] for i in range(4)]
    reference = _tokens(_engine(tiny_model_dir), prompts)
    cached = _engine(tiny_model_dir, enable_prefix_caching=True)
    first = _tokens(cached, prompts[:1])
    hits = queried = 0
    ids = [cached.add_request(p, GREEDY) for p in prompts[1:]]
    finals = {}
    while cached.has_unfinished_requests():
        outputs, stats = cached.step()
        hits += stats.num_prefix_hit_tokens
        queried += stats.num_prefix_queried_tokens
        finals.update({o.request_id: o for o in outputs if o.is_finished})
    assert hits == 3 * 64 and queried == 3 * 67
    assert first + [finals[i].token_ids for i in ids] == reference
    assert all(finals[i].metrics.num_cached_tokens == 64 for i in ids)


def test_long_prompt_does_not_stall_running_streams(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, max_num_batched_tokens=64, max_num_seqs=32)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    streams = [engine.add_request([3 + i, 4 + i, 5 + i], params) for i in range(16)]
    for _ in range(3):
        engine.step()
    long_id = engine.add_request([(j * 3) % 400 + 3 for j in range(1500)], SamplingParams(max_tokens=4))
    last_token_step = {rid: 0 for rid in streams}
    worst_gap, step, first_token_step = 0, 0, None
    while engine.has_unfinished_requests():
        step += 1
        outputs, stats = engine.step()
        assert stats.num_prefill_tokens + stats.num_decode_tokens <= 64
        for out in outputs:
            if out.request_id in last_token_step and out.new_token_ids:
                worst_gap = max(worst_gap, step - last_token_step[out.request_id])
                last_token_step[out.request_id] = step
            if out.request_id == long_id and out.new_token_ids and first_token_step is None:
                first_token_step = step
    assert worst_gap == 1  # every stream got a token every step while the prompt was chunked in
    # The long prompt still got its share: 1500 tokens at >= 16 per step (min_prefill_share 0.25 of 64).
    assert first_token_step is not None and first_token_step <= 1500 // 16 + 1


def test_decodes_cannot_starve_waiting_requests(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, max_num_batched_tokens=16, max_num_seqs=64, min_prefill_share=0.25)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for i in range(40):  # more decodes than the whole budget
        engine.add_request([3 + i, 4 + i], params)
    for _ in range(30):
        engine.step()
    late = engine.add_request([9, 9, 9, 9, 9, 9, 9, 9], SamplingParams(max_tokens=1))
    steps_to_finish = None
    for step in range(1, 10):
        outputs, _ = engine.step()
        if any(o.request_id == late and o.is_finished for o in outputs):
            steps_to_finish = step
            break
    assert steps_to_finish is not None and steps_to_finish <= 2  # 8 prompt tokens at a reserved 4 per step
    for rid in list(engine.scheduler.requests):
        engine.abort_request(rid)
    run_engine(engine)
    assert engine.block_manager.num_used_blocks == 0
