"""The learned step-time model and the time-aware prefill budget, on fabricated timings."""
from __future__ import annotations

import random

import numpy as np
import pytest

from engine import EngineConfig, PoolingParams, SamplingParams
from engine.core.block_manager import BlockManager
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence
from engine.core.step_cost_model import StepCostModel, attention_pairs
from tests.helpers import fake_seq, sampled

# A made-up machine: 25 ms to stream the weights, 0.3 ms per decode, 1.5 ms per prefill token,
# 4 ms per million attention pairs, 5 ms to set up prefill attention, 2 ms of host overhead.
TRUE = (0.025, 0.0003, 0.00002, 0.0015, 0.004, 0.005)
OVERHEAD = 0.002


def true_forward(num_decode: int, decode_ctx: int, num_prefill: int, pairs: float) -> float:
    w0, w_dec, w_ctx, w_pre, w_pairs, w_setup = TRUE
    return (w0 + w_dec * num_decode + w_ctx * decode_ctx / 1e3 + w_pre * num_prefill + w_pairs * pairs / 1e6
            + (w_setup if num_prefill else 0.0))


def feed(model: StepCostModel, num_steps: int, rng: random.Random, noise: float = 0.0) -> None:
    for _ in range(num_steps):
        num_decode = rng.choice([0, rng.randint(1, 32)])
        ctx = num_decode * rng.randint(20, 400)
        chunk = rng.choice([0, rng.randint(1, 512)]) if num_decode else rng.randint(1, 512)
        pairs = attention_pairs(chunk, rng.randint(0, 1500)) if chunk else 0.0
        t = true_forward(num_decode, ctx, chunk, pairs) * (1 + rng.uniform(-noise, noise))
        model.observe(num_decode, ctx, chunk, pairs, 0, t, OVERHEAD)


def test_converges_to_the_true_costs_within_a_few_dozen_steps() -> None:
    model = StepCostModel()
    feed(model, 50, random.Random(0))
    for num_decode, ctx, chunk, cached in [(8, 1600, 0, 0), (8, 1600, 64, 0), (32, 9000, 200, 1000), (0, 0, 512, 0)]:
        pairs = attention_pairs(chunk, cached)
        expected = true_forward(num_decode, ctx, chunk, pairs) + OVERHEAD
        assert model.predict(num_decode, ctx, chunk, pairs) == pytest.approx(expected, rel=0.08)


def test_follows_a_machine_that_slows_down_and_tolerates_noise() -> None:
    model = StepCostModel()
    rng = random.Random(1)
    feed(model, 40, rng, noise=0.1)
    global TRUE
    original = TRUE
    try:
        TRUE = tuple(2 * w for w in original)  # the machine halves its speed
        feed(model, 150, rng, noise=0.1)
        expected = true_forward(16, 3000, 100, attention_pairs(100, 0)) + OVERHEAD
        assert model.predict(16, 3000, 100, attention_pairs(100, 0)) == pytest.approx(expected, rel=0.15)
    finally:
        TRUE = original


def test_long_runs_of_one_kind_of_step_stay_stable() -> None:
    """Thousands of decode-only steps must not blow up the unexcited prefill directions."""
    model = StepCostModel()
    rng = random.Random(2)
    feed(model, 30, rng)
    for _ in range(5000):
        model.observe(16, 4000, 0, 0.0, 0, true_forward(16, 4000, 0, 0.0), OVERHEAD)
    feed(model, 3, rng)
    assert model.predict(16, 4000, 128, attention_pairs(128, 0)) == pytest.approx(
        true_forward(16, 4000, 128, attention_pairs(128, 0)) + OVERHEAD, rel=0.1)


def test_a_long_repeating_workload_never_diverges() -> None:
    """A batch-1 client's loop for 15,000 steps (a 32-token prompt, then 128 decodes), with 5 %
    jitter: the fit stays right and the covariance exactly symmetric. Forgetting grows any
    asymmetric rounding by 1 / decay a step, and before the update kept P exactly symmetric
    this run lost P's positive definiteness after 2,400 steps and the predictions diverged."""
    model = StepCostModel()
    rng = random.Random(3)
    worst = 0.0
    for i in range(15_000):
        position = i % 129
        step = (0, 0, 32, attention_pairs(32, 0)) if position == 0 else (1, 32 + position, 0, 0.0)
        t = true_forward(*step) * (1 + rng.uniform(0.0, 0.05))
        if i > 200 and position:
            worst = max(worst, abs(model.predict(*step) - OVERHEAD - t) / t)
        model.observe(*step, 0, t, OVERHEAD)
    assert worst < 0.1
    assert all(model.covariance[i][j] == model.covariance[j][i] for i in range(7) for j in range(7))


def test_tracks_the_97th_percentile_of_its_error() -> None:
    model = StepCostModel()
    rng = random.Random(5)
    feed(model, 40, rng)
    for _ in range(3000):  # the machine jitters: measured = true * U(0.8, 1.3), so p97 is 1.285
        model.observe(8, 1600, 0, 0.0, 0, true_forward(8, 1600, 0, 0.0) * rng.uniform(0.8, 1.3), OVERHEAD)
    mean_ratio = 1.05  # the fit follows the mean; the quantile is relative to it
    assert model.error_quantile == pytest.approx(1.285 / mean_ratio, abs=0.04)


def test_max_chunk_is_the_largest_that_fits() -> None:
    model = StepCostModel()
    feed(model, 40, random.Random(3))
    for time_left, cached, first in [(0.05, 0, False), (0.2, 0, True), (0.2, 3000, True)]:
        n = model.max_chunk(time_left, cached, limit=10_000, is_first=first)
        assert model.chunk_cost(n, cached, first) <= time_left < model.chunk_cost(n + 1, cached, first)
    assert model.max_chunk(10.0, 0, limit=77) == 77
    assert model.max_chunk(0.0, 0, limit=77) == 0


def _time_scheduler(**options: object) -> Scheduler:
    config = EngineConfig(max_num_batched_tokens=2048, min_prefill_share=0.0, **options)
    sched = Scheduler(config, BlockManager(2048, 16, enable_prefix_caching=False))
    feed(sched.cost_model, 40, random.Random(4))
    return sched


def _decoding(sched: Scheduler, n: int) -> None:
    for i in range(n):
        seq = fake_seq(f"d{i}", 40, num_output=1)
        sched.add(seq)
    out = sched.schedule(now=0.0)  # prefill them
    sched.update_from_output(out, sampled(out, 1), now=0.0)


@pytest.mark.parametrize("max_step_ms", [60.0, 120.0, 400.0])
def test_prefill_chunk_follows_the_step_time_target(max_step_ms: float) -> None:
    sched = _time_scheduler(max_step_ms=max_step_ms)
    _decoding(sched, 8)
    sched.add(fake_seq("long", 1500, arrival=1.0))
    out = sched.schedule(now=2.0)
    assert len(out.decode_req_ids) == 8 and out.budget_source == "time"
    assert out.step_time_target == pytest.approx(max_step_ms / 1e3)
    chunk = out.prefill_num_tokens[0]
    expected = true_forward(8, sum(sched.get(r).num_tokens for r in out.decode_req_ids), chunk, attention_pairs(chunk, 0))
    assert expected + OVERHEAD <= max_step_ms / 1e3  # and truly under the target
    # The chunk fills the target less the model's error margin (its p97 of measured / predicted).
    aim = max_step_ms / 1e3 / max(1.0, sched.cost_model.error_quantile)
    assert out.predicted_step_time <= aim or chunk == sched.min_chunk  # (a chunk is at least half a block)
    assert aim < out.predicted_step_time + 2 * TRUE[3]
    assert expected + OVERHEAD == pytest.approx(out.predicted_step_time, rel=0.05)


def test_auto_target_is_a_multiple_of_the_usual_decode_step_and_nothing_decoding_means_full_budget() -> None:
    sched = _time_scheduler(step_time_ratio=2.5)
    sched.add(fake_seq("first", 1500))
    out = sched.schedule(now=0.0)
    assert out.budget_source == "tokens" and out.prefill_num_tokens == [1500]  # nothing decodes yet
    sched = _time_scheduler(step_time_ratio=2.5)
    _decoding(sched, 8)
    for _ in range(300):  # decode-only steps of 50 ms set the streams' usual pace
        sched.cost_model.observe(8, 400, 0, 0.0, 0, 0.048, 0.002)
    sched.add(fake_seq("long", 1500, arrival=1.0))
    out = sched.schedule(now=2.0)
    assert out.step_time_target == pytest.approx(2.5 * 0.050, rel=0.02)
    assert out.predicted_step_time <= out.step_time_target


def test_auto_target_follows_the_batch_not_past_decode_only_steps() -> None:
    """Under a steady stream of arrivals every step carries a chunk: the target must grow
    with the batch that decodes now, not stay at the pace of the last decode-only steps (of a
    smaller batch)."""
    sched = _time_scheduler(step_time_ratio=2.0)
    for _ in range(200):  # a batch of 2 decoding alone
        sched.cost_model.observe(2, 100, 0, 0.0, 0, true_forward(2, 100, 0, 0.0), OVERHEAD)
    for _ in range(50):  # then only mixed steps while the batch grows to 24
        sched.cost_model.observe(24, 2400, 64, attention_pairs(64, 0), 0,
                                 true_forward(24, 2400, 64, attention_pairs(64, 0)), OVERHEAD)
    _decoding(sched, 24)
    sched.add(fake_seq("next", 300, arrival=1.0))
    out = sched.schedule(now=2.0)
    assert len(out.decode_req_ids) == 24
    ctx = sum(sched.get(r).num_tokens for r in out.decode_req_ids)
    pace = true_forward(24, ctx, 0, 0.0) + OVERHEAD
    assert out.step_time_target == pytest.approx(2.0 * pace, rel=0.05)


def test_a_run_whose_every_step_has_prefill_still_reads_the_streams_true_pace() -> None:
    """Requests arriving one after another from the start (a served closed loop): no step is
    decode-only, so the weights' read (w0) and the prefill set-up (w5) are one constant to the
    fit. The target must rest on their sum, not on the share the fit happens to give w0 (half,
    from equal priors: chunks were held to one block for dozens of steps)."""
    config = EngineConfig(max_num_batched_tokens=2048, min_prefill_share=0.0, step_time_ratio=2.0)
    sched = Scheduler(config, BlockManager(2048, 16, enable_prefix_caching=False))
    model = sched.cost_model
    model.observe(0, 0, 50, attention_pairs(50, 0), 0, true_forward(0, 0, 50, attention_pairs(50, 0)), OVERHEAD)
    rng = random.Random(7)
    for _ in range(30):
        num_decode, chunk = rng.randint(4, 12), rng.randint(16, 48)
        pairs = attention_pairs(chunk, 0)
        model.observe(num_decode, 100 * num_decode, chunk, pairs, 0, true_forward(num_decode, 100 * num_decode, chunk,
                                                                                pairs), OVERHEAD)
    _decoding(sched, 24)
    sched.add(fake_seq("next", 300, arrival=1.0))
    out = sched.schedule(now=2.0)
    ctx = sum(sched.get(r).num_tokens for r in out.decode_req_ids)
    pace = true_forward(24, ctx, 0, 0.0) + OVERHEAD + TRUE[5]
    assert out.step_time_target == pytest.approx(2.0 * pace, rel=0.1)
    # The set-up is paid once: the chunk fills the aim, not the aim less the set-up again.
    aim = out.step_time_target / max(1.0, model.error_quantile)
    chunk = out.prefill_num_tokens[0]
    assert out.predicted_step_time <= aim < out.predicted_step_time + 2 * TRUE[3]
    assert true_forward(24, ctx, chunk, attention_pairs(chunk, 0)) + OVERHEAD == pytest.approx(
        out.predicted_step_time, rel=0.1)


def test_a_burst_raises_the_auto_target_a_single_arrival_does_not() -> None:
    """Several requests waiting per running one (a burst) are worth slower steps; one waiting
    request (a long prompt arriving among streams) gets the streams' promised pace."""
    targets = {}
    for num_waiting in (1, 17):
        sched = _time_scheduler(step_time_ratio=2.0)
        _decoding(sched, 8)
        for _ in range(300):
            sched.cost_model.observe(8, 400, 0, 0.0, 0, 0.048, 0.002)
        for i in range(num_waiting):
            sched.add(fake_seq(f"w{i}", 300, arrival=1.0 + i))
        targets[num_waiting] = sched.schedule(now=30.0).step_time_target
    assert targets[1] == pytest.approx(2.0 * 0.050, rel=0.01)
    assert targets[17] == pytest.approx(targets[1] * (1 + (17 - Scheduler.BURST_QUEUE_SLACK) / 8))


def test_a_few_requests_behind_a_small_batch_are_not_a_burst() -> None:
    """Behind two streams, up to Scheduler.BURST_QUEUE_SLACK waiting requests leave the target
    where one does: counted per running stream (x2 for three) they doubled the steps of a lightly
    loaded server and put its top 1 % of gaps past 3x. A burst ramping up (three streams, 28
    behind them) still counts each request past the slack per stream: a floor of 8 streams on the
    batch instead held the ramp's target to about half and cost served throughput."""
    slack = Scheduler.BURST_QUEUE_SLACK
    targets = {}
    for num_running, num_waiting in ((2, 1), (2, slack), (2, slack + 4), (3, 1), (3, 28)):
        sched = _time_scheduler(step_time_ratio=2.0)
        _decoding(sched, num_running)
        for i in range(num_waiting):
            sched.add(fake_seq(f"w{i}", 300, arrival=1.0 + i))
        targets[num_running, num_waiting] = sched.schedule(now=30.0).step_time_target
    assert slack >= 3
    assert targets[2, slack] == pytest.approx(targets[2, 1])
    assert targets[2, slack + 4] == pytest.approx(targets[2, 1] * (1 + 4 / 2))
    assert targets[3, 28] == pytest.approx(targets[3, 1] * (1 + (28 - slack) / 3))


def test_a_long_prompt_always_advances_under_a_tight_target() -> None:
    sched = _time_scheduler(max_step_ms=1.0)  # less than the decodes alone
    _decoding(sched, 8)
    long = fake_seq("long", 100, arrival=1.0)
    sched.add(long)
    steps = 0
    while long.num_output_tokens == 0:
        out = sched.schedule(now=2.0)
        assert out.prefill_num_tokens == [min(sched.min_chunk, long.num_uncomputed_tokens)]  # half a block
        sched.update_from_output(out, sampled(out, 1), now=0.0)
        steps += 1
    assert sched.min_chunk == 8 and steps == 13  # 100 tokens, 8 a step


def test_learns_what_a_chunk_pays_per_cached_token() -> None:
    """Small chunks over a long cached context cost more than their attention pairs say (the
    prefill kernel lays the cached K/V out per layer): 13 ms per 1000 cached tokens here."""
    def forward(num_decode: int, chunk: int, cached: int) -> float:
        return (0.02 + 0.0005 * num_decode + 0.001 * chunk + 0.4 * attention_pairs(chunk, cached) / 1e6 + 0.003
                + 0.013 * cached / 1e3)

    model = StepCostModel()
    rng = random.Random(6)
    for _ in range(300):  # pairs and cached tokens move together in small chunks: slower to separate
        num_decode, chunk = rng.randint(1, 8), rng.randint(1, 64)
        cached = rng.choice([0, rng.randint(1, 2000)])
        model.observe(num_decode, 100 * num_decode, chunk, attention_pairs(chunk, cached), cached,
                      forward(num_decode, chunk, cached), OVERHEAD)
    pairs = attention_pairs(16, 1000)
    assert model.predict(2, 200, 16, pairs, 1000) == pytest.approx(forward(2, 16, 1000) + OVERHEAD, rel=0.05)
    assert model.chunk_cost(16, 1000) - model.chunk_cost(16, 0) == pytest.approx(
        forward(2, 16, 1000) - forward(2, 16, 0), rel=0.1)
    # So the chunk that fits a time slice shrinks with the context it reads, by that much.
    assert model.max_chunk(0.03, 1000, limit=512) < model.max_chunk(0.03, 0, limit=512) - 10


def test_a_burst_of_embeddings_keeps_eight_streams_at_their_promised_pace() -> None:
    """Twelve 400-token embedding requests arrive at once while 8 streams decode, on the made-up
    machine: every stream gets its token in every step, and each such step is held to
    step_time_ratio x the streams' decode-only step, its true time within it. A burst of
    generation requests would be granted slower steps (the backlog); pooling requests never join
    the batch, so they are no burst (counted as one, they had raised the target by 1 + 9 / 8).
    The embeddings are chunked in over many steps, and every one is pooled."""
    sched = _time_scheduler(step_time_ratio=2.0)
    for _ in range(300):  # the streams' decode-only steps: their pace is known
        sched.cost_model.observe(8, 400, 0, 0.0, 0, true_forward(8, 400, 0, 0.0), OVERHEAD)
    streams = SamplingParams(max_tokens=None, ignore_eos=True)
    for i in range(8):
        sched.add(fake_seq(f"d{i}", 40, num_output=1, params=streams))
    sched.update_from_output(first := sched.schedule(now=0.0), sampled(first), now=0.0)
    embeddings = PoolingParams(pooling_type="last", normalize=True)
    for i in range(12):
        sched.add(Sequence(request_id=f"e{i}", prompt_token_ids=list(range(1, 401)), params=SamplingParams(),
                           arrival_time=1.0, pooling_params=embeddings))
    pooled: list[str] = []
    num_steps = 0
    while len(pooled) < 12:
        out = sched.schedule(now=2.0)
        num_steps += 1
        assert len(out.decode_req_ids) == 8 and out.budget_source == "time"
        ctx = sum(sched.get(r).num_tokens for r in out.decode_req_ids)
        pace = true_forward(8, ctx, 0, 0.0) + OVERHEAD
        assert out.step_time_target == pytest.approx(2.0 * pace, rel=0.05)
        pairs = sum(attention_pairs(n, done) for n, done in zip(out.prefill_num_tokens, out.prefill_num_computed,
                                                                strict=True))
        forward = true_forward(8, ctx, sum(out.prefill_num_tokens), pairs)
        assert forward + OVERHEAD <= out.step_time_target
        ended = [r for r, last, is_pooling in zip(out.prefill_req_ids, out.prefill_is_last_chunk,
                                                  out.prefill_is_pooling, strict=True) if last and is_pooling]
        runner = sampled(out)
        runner.pooled_req_ids, runner.pooled = ended, [[1.0]] * len(ended)
        sched.update_from_output(out, runner, now=2.0)
        sched.observe_step_time(out, forward, OVERHEAD)
        pooled += ended
    assert sorted(pooled) == sorted(f"e{i}" for i in range(12))
    assert num_steps > 100  # chunked in by the time budget (the token budget alone takes 10 steps)
    assert sched.num_running == 8


# A made-up MoE machine: 8 layers of 64 experts, 4 a token; a step streams the dense weights
# (10 ms), then reads each distinct expert a layer routes to (0.3 ms each), whatever its rows.
MOE_E, MOE_K, MOE_LAYERS, MOE_EXPERT_READ = 64, 4, 8, 0.0003


def moe_forward(num_decode: int, num_prefill: int, rng: random.Random) -> float:
    """Routing drawn token by token (k distinct of E each, layer by layer), not the formula."""
    tokens = num_decode + num_prefill
    draws = np.random.default_rng(rng.randrange(2**32)).random((MOE_LAYERS, tokens, MOE_E))
    chosen = np.argpartition(draws, MOE_K, axis=-1)[..., :MOE_K]  # [layers, tokens, k]: k distinct of E
    touched = sum(len(np.unique(layer)) for layer in chosen)
    return 0.010 + 0.00002 * tokens + MOE_EXPERT_READ * touched


def moe_steps(num_steps: int, rng: random.Random) -> list[tuple[int, int, float]]:
    steps = []
    for _ in range(num_steps):
        num_decode = rng.randint(1, 48)
        chunk = rng.choice([0, 0, rng.randint(1, 256)])
        steps.append((num_decode, chunk, moe_forward(num_decode, chunk, rng)))
    return steps


def test_moe_steps_are_fitted_by_the_experts_they_touch_better_than_by_tokens() -> None:
    rng = random.Random(0)
    moe, tokens_only = StepCostModel(experts=(MOE_E, MOE_K)), StepCostModel()
    for model in (moe, tokens_only):
        for num_decode, chunk, t in moe_steps(150, random.Random(1)):
            model.observe(num_decode, num_decode * 100, chunk, attention_pairs(chunk, 0), 0, t, OVERHEAD)
    held_out = moe_steps(100, rng)

    def error(model: StepCostModel) -> float:  # mean |predicted / measured - 1|
        return sum(abs(model.predict(d, d * 100, c, attention_pairs(c, 0)) / (t + OVERHEAD) - 1)
                   for d, c, t in held_out) / len(held_out)

    assert error(moe) < 0.03 and error(moe) < error(tokens_only) / 3, (error(moe), error(tokens_only))
    # the learned cost per expected expert of a layer: every layer's read of one expert
    assert moe.costs[7] == pytest.approx(MOE_LAYERS * MOE_EXPERT_READ, rel=0.1)


def test_a_moe_chunk_costs_the_experts_the_step_has_not_touched_yet() -> None:
    model = StepCostModel(experts=(MOE_E, MOE_K))
    for num_decode, chunk, t in moe_steps(150, random.Random(2)):
        model.observe(num_decode, num_decode * 100, chunk, attention_pairs(chunk, 0), 0, t, OVERHEAD)
    # beside 40 decodes most experts are already read: a chunk adds less than alone
    assert model.chunk_cost(16, 0, num_step_tokens=40) < model.chunk_cost(16, 0, num_step_tokens=0)
    for time_left, step_tokens in [(0.002, 0), (0.01, 8), (0.05, 40)]:
        n = model.max_chunk(time_left, 0, limit=10_000, num_step_tokens=step_tokens)
        assert model.chunk_cost(n, 0, num_step_tokens=step_tokens) <= time_left
        assert model.chunk_cost(n + 1, 0, num_step_tokens=step_tokens) > time_left


def test_a_dense_model_keeps_its_seven_features() -> None:
    dense, moe = StepCostModel(), StepCostModel(experts=(MOE_E, MOE_K))
    assert dense.experts is None and len(dense.weights) == 7 and len(dense.features(3, 300, 16, 100.0)) == 7
    assert moe.features(3, 300, 16, 100.0)[:7] == dense.features(3, 300, 16, 100.0)
    assert moe.features(3, 300, 16, 100.0)[7] == pytest.approx(MOE_E * (1 - (1 - MOE_K / MOE_E) ** 19))
    config = EngineConfig(num_kv_blocks=64)
    assert Scheduler(config, BlockManager(64, 16)).cost_model.experts is None
    assert Scheduler(config, BlockManager(64, 16), experts=(8, 2)).cost_model.experts == (8, 2)
    with pytest.raises(ValueError, match="experts"):
        StepCostModel(experts=(4, 8))
