"""Async scheduling: step n+1 is scheduled and submitted before step n's tokens are processed.

Every test drives the overlapped loop against the synchronous one on the same model, with a
fake device latency (each runner call sleeps first, as a GPU's forward keeps the host waiting)
so the engine thread really processes step n while step n+1 runs on the worker: outputs must
be the synchronous loop's, token for token, and nothing accepted may be lost or leak blocks.
"""
from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest

from engine import LLM, EngineConfig, LLMEngine, PoolingParams, SamplingParams, StructuredOutput
from engine.outputs import FinishReason
from service.grpc.minivllm_client import InferenceClient
from tests.helpers import run_engine
from tests.server_harness import ServerThread

DEVICE_LATENCY_S = 0.002
HOST_LATENCY_S = 0.003  # processing a step's tokens: longer than the worker takes to the next sampling
REGEX = r"[0-9]{2,4}-[a-z]{3,8}"
PROMPTS = ["the quick brown fox jumps", "hello there my friend", "a b c d e f g h i j k l m n", "one",
           "The code is", "Pick:", "numbers: 1 2 3", "the quick brown fox jumps"]


def _params() -> list[SamplingParams]:
    """One request of each kind the loop must keep exact."""
    return [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),  # greedy to max_tokens
        SamplingParams(temperature=1.0, seed=5, max_tokens=17, top_k=20, top_p=0.9),  # seeded, may hit EOS
        SamplingParams(temperature=0, max_tokens=40, stop=["e"], ignore_eos=True),  # a stop string ends it
        SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=9, ignore_eos=True),  # forks
        SamplingParams(temperature=0.8, seed=2, max_tokens=40, structured_output=StructuredOutput("regex", REGEX)),
        SamplingParams(temperature=0, max_tokens=30, structured_output=StructuredOutput.choice(["alpha", "beta gamma"])),
        SamplingParams(temperature=0.7, seed=9, max_tokens=12, logprobs=2, prompt_logprobs=1,
                       repetition_penalty=1.3, min_tokens=5),
        SamplingParams(temperature=0, max_tokens=1),  # ends at its prefill
    ]


def _with_device_latency(engine: LLMEngine) -> list[tuple[str, int]]:
    """Each runner call sleeps first (the device), and so does processing a step's tokens (the
    host: a sampling that did not wait for it would read a grammar's state before that step's
    token); returns the log of schedule ('S') and process ('P') calls, with each step's number."""
    log: list[tuple[str, int]] = []
    execute, schedule, update = engine.runner.execute, engine.scheduler.schedule, engine.scheduler.update_from_output
    steps: dict[int, int] = {}  # by id() of each step's value, kept alive below so no id is reused
    scheds: list[Any] = []

    def slow_execute(*args: Any, **kwargs: Any) -> Any:
        time.sleep(DEVICE_LATENCY_S)
        return execute(*args, **kwargs)

    def logged_schedule(now: float) -> Any:
        sched = schedule(now)
        if not sched.is_empty:
            scheds.append(sched)
            steps[id(sched)] = len(scheds)
            log.append(("S", steps[id(sched)]))
        return sched

    def logged_update(sched: Any, out: Any, now: float) -> Any:
        log.append(("P", steps[id(sched)]))
        time.sleep(HOST_LATENCY_S)
        return update(sched, out, now)

    engine.runner.execute = slow_execute
    engine.scheduler.schedule = logged_schedule
    engine.scheduler.update_from_output = logged_update
    return log


def _generate(model_dir: Path, prompts: list[str], params: list[SamplingParams], **config: Any
              ) -> tuple[list[Any], LLM, list[tuple[str, int]]]:
    llm = LLM(str(model_dir), **config)
    log = _with_device_latency(llm.engine)
    return llm.generate(prompts, params), llm, log


def _tokens(outs: list[Any]) -> list[Any]:
    return [[(s.token_ids, s.text, s.finish_reason) for s in (o.samples or [o])] for o in outs]


def _logprobs(outs: list[Any]) -> list[tuple[int, int, float]]:
    """Every reported logprob as (output, position, token, value), prompt logprobs too."""
    values = []
    for i, out in enumerate(outs):
        for sample in out.samples or [out]:
            for kind, entries in (("out", sample.logprobs), ("prompt", sample.prompt_logprobs)):
                for position, entry in enumerate(entries or []):
                    values += [((i, sample.index, kind, position, token), value)
                               for token, value in sorted((entry or {}).items())]
    return values


def _assert_all_freed(llm: LLM) -> None:
    engine = llm.engine
    assert engine.num_steps_in_flight == 0 and not engine.has_unfinished_requests()
    assert engine.block_manager.count_referenced_blocks() == 0 == engine.block_manager.num_used_blocks


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_outputs_equal_the_synchronous_loop(tiny_model_dir: Path, backend: str) -> None:
    config = dict(num_kv_blocks=512, block_size=4, max_num_batched_tokens=64, backend=backend)
    sync, _, sync_log = _generate(tiny_model_dir, PROMPTS, _params(), **config)
    overlapped, llm, log = _generate(tiny_model_dir, PROMPTS, _params(), async_scheduling=True, **config)
    assert _tokens(overlapped) == _tokens(sync)
    # A step may carry a row of a request that ended meanwhile (its token dropped): the CPU
    # kernels' sums depend on a step's row count in the float's last bits, as any change of the
    # batch moves them in the synchronous loop; so do torch's on some CPUs (its GEMM's blocking
    # follows the row count: up to 8e-6 relative on an AVX2-only AMD EPYC, none on AVX-512 Xeons;
    # its bound has room above that, still far below any other token's logprob).
    got, want = _logprobs(overlapped), _logprobs(sync)
    assert [key for key, _ in got] == [key for key, _ in want] and len(want) > 20
    tolerance = 5e-5 if backend == "torch" else 1e-5
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=tolerance, abs=tolerance)
    assert re.fullmatch(REGEX, overlapped[4].text) and overlapped[5].text in ("alpha", "beta gamma")
    assert overlapped[2].finish_reason == "stop" and "e" not in overlapped[2].text
    _assert_all_freed(llm)
    # The synchronous loop processes each step before scheduling the next; the overlapped one
    # schedules step n + 1 before it processes step n, at every step.
    assert sync_log == [entry for n in range(1, len(sync_log) // 2 + 1) for entry in (("S", n), ("P", n))]
    scheduled = {n: i for i, (kind, n) in enumerate(log) if kind == "S"}
    processed = {n: i for i, (kind, n) in enumerate(log) if kind == "P"}
    assert sorted(processed) == sorted(scheduled)
    assert all(scheduled[n + 1] < processed[n] for n in processed if n + 1 in scheduled)


def test_speculation_is_refused_by_name(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="async_scheduling.*speculative_method"):
        EngineConfig(model=str(tiny_model_dir), async_scheduling=True, speculative_method="ngram")


def test_preemption_inside_the_lag_loses_nothing(tiny_model_dir: Path) -> None:
    # 24 blocks of 4 tokens for 6 requests of ~45 tokens: decodes preempt the newest running
    # sequences, also while that sequence's own step is still in flight.
    config = dict(num_kv_blocks=24, block_size=4, max_num_batched_tokens=40, max_num_seqs=6)
    prompt = "one two three four five six seven eight nine ten eleven twelve"
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 3 + \
             [SamplingParams(temperature=1.0, seed=s, max_tokens=24, ignore_eos=True) for s in range(3)]
    sync, _, _ = _generate(tiny_model_dir, [prompt] * 6, params, **config)
    overlapped, llm, _ = _generate(tiny_model_dir, [prompt] * 6, params, async_scheduling=True, **config)
    assert _tokens(overlapped) == _tokens(sync)
    assert all(len(o.token_ids) == 24 for o in overlapped)
    assert sum(o.metrics.num_preemptions for o in overlapped) > 0, "the cache was meant to force preemptions"
    _assert_all_freed(llm)


def test_an_abort_inside_the_lag_ends_the_request_and_frees_its_blocks(tiny_model_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256, block_size=4,
                                    async_scheduling=True, enable_prefix_caching=False))
    _with_device_latency(engine)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kept = engine.add_request("hello there my friend", greedy)
    aborted = engine.add_request("the quick brown fox", greedy)
    outputs: dict[str, list[Any]] = {}
    for _ in range(5):
        for out in engine.step()[0]:
            outputs.setdefault(out.request_id, []).append(out)
    assert engine.num_steps_in_flight == 1  # a step that decodes `aborted` is running
    engine.abort_request(aborted)
    rest, _ = run_engine(engine)
    for request_id, outs in rest.items():
        outputs.setdefault(request_id, []).extend(outs)
    assert outputs[aborted][-1].finish_reason == FinishReason.ABORT.value
    assert sum(1 for o in outputs[aborted] if o.is_finished) == 1
    alone = LLM(str(tiny_model_dir), num_kv_blocks=256, block_size=4).generate(["hello there my friend"], greedy)[0]
    assert [t for o in outputs[kept] for t in o.new_token_ids] == alone.token_ids
    assert engine.num_steps_in_flight == 0
    assert engine.block_manager.num_used_blocks == 0


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(tiny_model_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256, block_size=4,
                                    async_scheduling=True))
    _with_device_latency(engine)
    failed = engine.add_request("hello there", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()
    engine.fail_next_step("injected")
    outputs, _ = run_engine(engine)
    assert outputs[failed][-1].finish_reason == FinishReason.ERROR.value and "injected" in outputs[failed][-1].error
    after = engine.add_request("hello there", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    outputs, _ = run_engine(engine)
    assert len([t for o in outputs[after] for t in o.new_token_ids]) == 8
    assert engine.block_manager.count_referenced_blocks() == 0


def test_fail_all_waits_for_the_steps_in_flight(tiny_model_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256, block_size=4,
                                    async_scheduling=True, enable_prefix_caching=False))
    _with_device_latency(engine)
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)) for p in PROMPTS[:3]]
    for _ in range(4):
        engine.step()
    assert engine.num_steps_in_flight == 1
    outputs = engine.fail_all("engine stopped")
    assert sorted(o.request_id for o in outputs if o.is_finished) == sorted(ids)
    assert engine.num_steps_in_flight == 0 and not engine.has_unfinished_requests()
    assert engine.block_manager.num_used_blocks == 0


def test_embeddings_equal_the_synchronous_loop(tiny_model_dir: Path) -> None:
    """Pooling prompts end at their last chunk: in flight they have nothing left to schedule,
    and the generation beside them goes on."""
    config = dict(num_kv_blocks=512, block_size=4, max_num_batched_tokens=16)
    texts = ["a b c d e f g h i j k l m n o p q r s t", "hello there", "one two three four five six seven"]
    vectors = {}
    for is_async in (False, True):
        llm = LLM(str(tiny_model_dir), async_scheduling=is_async, **config)
        _with_device_latency(llm.engine)
        engine = llm.engine
        gen = engine.add_request("the quick brown fox", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        embeds = [engine.add_request(t, PoolingParams()) for t in texts]
        outputs, _ = run_engine(engine)
        vectors[is_async] = ([outputs[r][-1].embedding for r in embeds],
                             [t for o in outputs[gen] for t in o.new_token_ids])
        _assert_all_freed(llm)
    assert vectors[True] == vectors[False]


def test_stats_count_every_token_once(tiny_model_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256, block_size=4,
                                    async_scheduling=True))
    for prompt in PROMPTS[:4]:
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    generated = decode_tokens = 0
    step_ids = []
    while engine.has_unfinished_requests():
        _, stats = engine.step()
        generated += stats.num_generated_tokens
        decode_tokens += stats.num_decode_tokens
        step_ids.append(stats.step_id)
    assert generated == 40
    assert decode_tokens == 4 * 9  # each request's first token comes from its prefill
    assert step_ids == sorted(step_ids) and len(set(step_ids)) == len(step_ids)


def test_a_stream_through_grpc(tiny_model_dir: Path) -> None:
    srv = ServerThread(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256, async_scheduling=True))
    try:
        with InferenceClient(srv.target) as client:
            chunks = list(client.generate("The code is", max_tokens=40, temperature=0.7, seed=3, regex=REGEX))
            text = "".join(c.text for c in chunks)
            assert re.fullmatch(REGEX, text), text
            again = list(client.generate("The code is", max_tokens=40, temperature=0.7, seed=3, regex=REGEX))
            assert "".join(c.text for c in again) == text
    finally:
        srv.stop()


def test_generated_blocks_reach_the_prefix_cache_with_their_tokens(tiny_model_dir: Path) -> None:
    """A block is published once its tokens are all known: a later prompt that repeats a
    request's prompt and output hits every full block of both, as in the synchronous loop (a
    block hashed while it held a step's placeholder would never match)."""
    hits = {}
    for is_async in (False, True):
        llm = LLM(str(tiny_model_dir), num_kv_blocks=256, block_size=4, async_scheduling=is_async)
        _with_device_latency(llm.engine)
        prompt = llm.engine.tokenize("the quick brown fox jumps")
        first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))[0]
        again = llm.generate([prompt + first.token_ids], SamplingParams(temperature=0, max_tokens=2))[0]
        hits[is_async] = again.num_cached_tokens
    assert hits[True] == hits[False] >= 4 * ((len(prompt) + 12) // 4)


def test_a_failed_step_costs_only_its_own_requests(tiny_model_dir: Path) -> None:
    """The fault hits the step that admits `failed`; the step after it, scheduled and in flight
    already, runs `failed`'s row as a dropped one and serves `after`, admitted there, in full."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256, block_size=4,
                                    async_scheduling=True))
    _with_device_latency(engine)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    running = engine.add_request("one two three", greedy)
    engine.step()  # running's prefill, in flight
    engine.fail_next_step("injected")
    failed = engine.add_request("hello there", greedy)
    outputs: dict[str, list[Any]] = {}
    for out in engine.step()[0]:  # the failing step (running's decode, failed's prefill) is submitted
        outputs.setdefault(out.request_id, []).append(out)
    after = engine.add_request("the quick brown fox", greedy)
    rest, _ = run_engine(engine)
    for request_id, outs in rest.items():
        outputs.setdefault(request_id, []).extend(outs)
    for request_id in (running, failed):
        assert outputs[request_id][-1].finish_reason == FinishReason.ERROR.value
    alone = LLM(str(tiny_model_dir), num_kv_blocks=256, block_size=4).generate(["the quick brown fox"], greedy)[0]
    assert [t for o in outputs[after] for t in o.new_token_ids] == alone.token_ids
    assert outputs[after][-1].finish_reason == FinishReason.LENGTH.value
    assert engine.block_manager.count_referenced_blocks() == 0


def test_a_failed_chunk_leaves_nothing_in_the_prefix_cache(tiny_model_dir: Path) -> None:
    """A chunk's blocks reach the cache only once its step is processed: processing chunk 1
    while chunk 2 runs publishes chunk 1's block alone, and chunk 2's step fails (its K/V never
    written), so the same prompt again hits one block, and its tokens are a fresh engine's."""
    config = dict(model=str(tiny_model_dir), num_kv_blocks=256, block_size=4, max_num_batched_tokens=4)
    engine = LLMEngine(EngineConfig(async_scheduling=True, **config))
    _with_device_latency(engine)
    prompt = engine.tokenize("a b c d e f g h i j k l m n")[:12]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    failed = engine.add_request(prompt, greedy)
    engine.step()  # chunk 1 in flight
    engine.fail_next_step("injected")
    engine.step()  # chunk 2 submitted (it will fail); chunk 1 processed
    outputs, _ = run_engine(engine)
    assert outputs[failed][-1].finish_reason == FinishReason.ERROR.value
    again = engine.add_request(prompt, greedy)
    outputs, _ = run_engine(engine)
    assert outputs[again][-1].num_cached_tokens == 4
    fresh = LLM(**config, enable_prefix_caching=False).generate([prompt], greedy)[0]
    assert [t for o in outputs[again] for t in o.new_token_ids] == fresh.token_ids


def test_an_id_taken_again_inside_the_lag_is_a_new_request(tiny_model_dir: Path) -> None:
    """Abort X while its step runs and admit a new X at once: the old step's token is not the new one's."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256, block_size=4,
                                    async_scheduling=True))
    _with_device_latency(engine)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("hello there my friend", greedy, request_id="x")
    for _ in range(4):
        engine.step()
    assert engine.num_steps_in_flight == 1
    engine.abort_request("x")
    engine.add_request("the quick brown fox", greedy, request_id="x")
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step()[0]:
            if out.finish_reason != FinishReason.ABORT.value:
                tokens += out.new_token_ids
    alone = LLM(str(tiny_model_dir), num_kv_blocks=256, block_size=4).generate(["the quick brown fox"], greedy)[0]
    assert tokens == alone.token_ids
