"""Scheduling policies on the tiny model: each gives exactly the tokens of a run without it."""
from __future__ import annotations

from pathlib import Path

from engine import LLMEngine, SamplingParams
from engine.config import EngineConfig
from tests.helpers import run_engine

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
