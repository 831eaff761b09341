"""Hostile and careless clients, faults and identity: no request can freeze, hang or confuse another."""
from __future__ import annotations

import asyncio
import gc
import math
import random
import resource
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from service.grpc.minivllm_client import build_request
from service.pb import inference_pb2 as pb
from service.pb import inference_pb2_grpc as pb_grpc
from tests.helpers import run_engine
from tests.server_harness import ServerProcess, ServerThread, poll

INVALID, TOO_BIG = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED
SP = pb.SamplingParams

# (name, request, expected code, text the message must name)
BAD_INPUTS = [
    ("temperature NaN", build_request("hi", temperature=math.nan), INVALID, "temperature"),
    ("temperature inf", build_request("hi", temperature=math.inf), INVALID, "temperature"),
    ("temperature < 0", build_request("hi", temperature=-1), INVALID, "temperature"),
    ("top_p 0", build_request("hi", top_p=0), INVALID, "top_p"),
    ("top_p NaN", build_request("hi", top_p=math.nan), INVALID, "top_p"),
    ("top_p > 1", build_request("hi", top_p=1.5), INVALID, "top_p"),
    ("min_p > 1", build_request("hi", min_p=2), INVALID, "min_p"),
    ("min_p NaN", build_request("hi", min_p=math.nan), INVALID, "min_p"),
    ("repetition_penalty NaN", build_request("hi", repetition_penalty=math.nan), INVALID, "repetition_penalty"),
    ("repetition_penalty 0", build_request("hi", repetition_penalty=0), INVALID, "repetition_penalty"),
    ("presence_penalty 3", build_request("hi", presence_penalty=3), INVALID, "presence_penalty"),
    ("frequency_penalty inf", build_request("hi", frequency_penalty=math.inf), INVALID, "frequency_penalty"),
    ("top_k -5", build_request("hi", top_k=-5), INVALID, "top_k"),
    ("max_tokens 0", build_request("hi", max_tokens=0), INVALID, "max_tokens"),
    ("min_tokens > max_tokens", build_request("hi", min_tokens=9, max_tokens=2), INVALID, "min_tokens"),
    ("logprobs 99", build_request("hi", logprobs=99), INVALID, "logprobs"),
    ("empty stop string", build_request("hi", stop=[""]), INVALID, "stop"),
    ("stop id outside vocab", build_request("hi", stop_token_ids=[10**6]), INVALID, "stop_token_ids"),
    ("empty prompt", pb.GenerateRequest(prompt=""), INVALID, "prompt"),
    ("no input", pb.GenerateRequest(), INVALID, "input"),
    ("empty token ids", pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[])), INVALID, "prompt_token_ids"),
    ("token id outside vocab", build_request([1, 999_999]), INVALID, "prompt_token_ids"),
    ("empty messages", pb.GenerateRequest(messages=pb.Messages()), INVALID, "messages"),
    ("unknown role", build_request([{"role": "wizard", "content": "x"}]), INVALID, "role"),
    ("priority -2^31", build_request("hi", priority=-2**31), INVALID, "priority"),
    ("priority 2^31-1", build_request("hi", priority=2**31 - 1), INVALID, "priority"),
    ("max_tokens 4,000,000", build_request("hi", max_tokens=4_000_000), TOO_BIG, "max_tokens"),
    ("max_tokens past the context", build_request([7] * 4000, max_tokens=200), TOO_BIG, "max_tokens"),
    ("prompt over the context", build_request([7] * 5000), TOO_BIG, "prompt"),
    ("2 MB prompt", build_request("x" * 2_000_000), TOO_BIG, "prompt"),
    ("900k-char prompt (more characters than the context's tokens could cover)",
     build_request("hello world " * 75_000), TOO_BIG, "prompt"),
    ("48k-char prompt (tokenized, then too long)", build_request("hello world " * 4_000), TOO_BIG, "prompt"),
    ("900k-char chat message (refused untokenized, as the prompt)",
     build_request([{"role": "user", "content": "hello world " * 75_000}]), TOO_BIG, "messages"),
    ("2 MB chat message", build_request([{"role": "user", "content": "y" * 2_000_000}]), TOO_BIG, "messages"),
    ("5 MB message", build_request("z" * 5_000_000), TOO_BIG, ""),
    ("5,000 stop strings of 300 chars", build_request("hi", stop=["s" * 300] * 5000), TOO_BIG, "stop"),
    ("one 300-char stop string", build_request("hi", stop=["s" * 300]), TOO_BIG, "stop"),
    ("1,000 stop token ids", build_request("hi", stop_token_ids=list(range(1000))), TOO_BIG, "stop_token_ids"),
    ("1 MB request id", build_request("hi", request_id="r" * 1_000_000), TOO_BIG, "request_id"),
]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path):
    srv = ServerThread(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=1100, block_size=4,
                                    max_num_waiting=64))
    yield srv
    srv.stop()


def _serving(channel: grpc.Channel) -> bool:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def real_server():
    # The real model: its decode step (tens of ms) is what a stall is measured against.
    srv = ServerThread(EngineConfig(num_kv_blocks=512, max_model_len=4096, max_num_waiting=64))
    yield srv
    srv.stop()


@pytest.mark.real_model
def test_bad_inputs_get_their_status_while_a_stream_keeps_its_pace(real_server: ServerThread) -> None:
    """Each bad or abusive request is refused with its code, naming the field, and the server stays
    SERVING; meanwhile an ordinary stream's largest gap stays within 5x its median gap (a 48k-char
    prompt is tokenized, off the engine thread, before it is found too long; a 900k-char one is
    refused untokenized: no 81-character token could fit it into the context)."""
    assert len(BAD_INPUTS) >= 30
    server = real_server
    # A serving process collects and freezes its heap once its engine has loaded (LLMEngine); this
    # test process also holds what earlier tests' engines left. In two full-suite runs the stream
    # stalled ~95 ms once (never alone, and tokenizing the 48k-char prompt takes 12 ms); a full
    # collection of that heap is the likely cause, so it is frozen here too.
    gc.collect()
    gc.freeze()

    async def run() -> tuple[list[float], list[str]]:
        options = [("grpc.max_send_message_length", 8 * 2**20)]
        async with grpc.aio.insecure_channel(server.target, options=options) as channel:
            stub = pb_grpc.InferenceStub(channel)
            arrivals: list[float] = []
            finished = asyncio.Event()

            async def ordinary() -> None:
                request = build_request("The ordinary stream", max_tokens=3000, temperature=0, ignore_eos=True)
                async for chunk in stub.Generate(request):
                    arrivals.extend([time.monotonic()] * len(chunk.token_ids))
                    if finished.is_set():
                        return

            task = asyncio.create_task(ordinary())
            while len(arrivals) < 20:
                await asyncio.sleep(0.005)
            start = len(arrivals)
            problems = []
            for name, request, code, field in BAD_INPUTS:
                try:
                    async for _ in stub.Generate(request, timeout=60):
                        pass
                    problems.append(f"{name}: accepted")
                except grpc.aio.AioRpcError as err:
                    if err.code() != code or field not in (err.details() or ""):
                        problems.append(f"{name}: {err.code().name} {err.details()!r}")
            end = len(arrivals)
            while len(arrivals) < end + 25:  # a calm stretch after the abuse, for the median (and > 20 gaps)
                await asyncio.sleep(0.005)
            finished.set()
            await task
            return arrivals[start:], problems

    arrivals, problems = asyncio.run(run())
    assert not problems, "\n".join(problems)
    with grpc.insecure_channel(server.target) as channel:
        assert _serving(channel)
    gaps = sorted(b - a for a, b in zip(arrivals, arrivals[1:], strict=False))
    assert len(gaps) > 20, "the ordinary stream stopped"
    median = gaps[len(gaps) // 2]
    assert gaps[-1] <= 5 * max(median, 0.002), f"worst gap {gaps[-1]:.4f} s, median {median:.4f} s"


def test_reusing_a_cancelled_id_gets_a_fresh_request(server: ServerThread) -> None:
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        first = stub.Generate(build_request("again", request_id="same-id", max_tokens=3000, ignore_eos=True))
        next(first)
        first.cancel()
        # At once, same id: it must get its own whole output, not the old request's abort.
        chunks = list(stub.Generate(build_request("again", request_id="same-id", max_tokens=20, ignore_eos=True,
                                                  temperature=0), timeout=60))
    assert chunks[-1].finish_reason == "length" and sum(len(c.token_ids) for c in chunks) == 20
    assert {c.request_id for c in chunks} == {"same-id"}


def test_a_second_live_request_with_the_same_id_is_already_exists(server: ServerThread) -> None:
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        live = stub.Generate(build_request("first", request_id="dup", max_tokens=3000, ignore_eos=True))
        next(live)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(build_request("second", request_id="dup", max_tokens=2), timeout=30))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS and "dup" in err.value.details()
        live.cancel()
        assert server.wait_until(lambda: server.engine.num_running == 0)
        # Once the first has ended the id is free again.
        assert list(stub.Generate(build_request("third", request_id="dup", max_tokens=2), timeout=30))[-1] \
            .finish_reason == "length"


def test_a_fault_in_one_requests_output_fails_only_that_request(tiny_llm: LLM) -> None:
    engine = tiny_llm.engine
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    ids = [engine.add_request([3, 4, 5 + i], params) for i in range(4)]
    victim = engine.output_processor.states[ids[1]]

    def broken(token_ids: list[int]) -> str:
        raise RuntimeError("detokenizer broke")

    victim.detokenizer.add_tokens = broken
    outputs, _ = run_engine(engine)
    reasons = {rid: outputs[rid][-1].finish_reason for rid in ids}
    assert reasons == {ids[0]: "length", ids[1]: "error", ids[2]: "length", ids[3]: "length"}
    assert "detokenizer broke" in outputs[ids[1]][-1].error
    assert engine.block_manager.num_used_blocks == 0


def test_a_step_that_raises_fails_its_requests_and_the_engine_goes_on(tiny_model_dir: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINIVLLM_FAULT", "raise@3")
    srv = ServerThread(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256))
    try:
        with grpc.insecure_channel(srv.target) as channel:
            stub = pb_grpc.InferenceStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(build_request("boom", max_tokens=10, ignore_eos=True), timeout=30))
            assert err.value.code() == grpc.StatusCode.INTERNAL and "injected fault" in err.value.details()
            after = list(stub.Generate(build_request("after", max_tokens=5, ignore_eos=True), timeout=30))
            assert after[-1].finish_reason == "length" and _serving(channel)
        assert srv.wait_until(lambda: srv.engine.block_manager.num_used_blocks == 0)
    finally:
        srv.stop()


def test_engine_thread_death_fails_calls_fast_and_exits_non_zero(tiny_model_dir: Path) -> None:
    server = ServerProcess(tiny_model_dir, "--num-kv-blocks", "256", env={"MINIVLLM_FAULT": "die@4"})
    try:
        with grpc.insecure_channel(server.target) as channel:
            assert poll(lambda: _serving_or_none(channel), 120)
            stub = pb_grpc.InferenceStub(channel)
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(build_request("doomed", max_tokens=50, ignore_eos=True), timeout=30))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - started < 10  # failed, not hung until the deadline
        assert server.proc.wait(30) != 0
    finally:
        server.close()
    assert "the engine thread died" in server.output


def _serving_or_none(channel: grpc.Channel) -> bool:
    try:
        return _serving(channel)
    except grpc.RpcError:
        return False


def test_a_prefix_hash_collision_never_serves_foreign_kv(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [list(range(10, 60)), list(range(200, 250)), list(range(10, 40)) + list(range(300, 320))]
    reference = LLM(str(tiny_model_dir), num_kv_blocks=256, block_size=4, enable_prefix_caching=False)
    expected = [o.token_ids for o in reference.generate(prompts, params)]
    import engine.core.block_manager as block_manager

    monkeypatch.setattr(block_manager, "hash_block", lambda parent, tokens: 42)  # every block collides
    cached = LLM(str(tiny_model_dir), num_kv_blocks=256, block_size=4, enable_prefix_caching=True)
    got = [cached.generate([p], params)[0].token_ids for p in prompts]  # one by one: later ones look up
    assert got == expected


def test_soak_with_cancels_and_bad_inputs(server: ServerThread) -> None:
    """A few hundred requests at concurrency 32, a fifth cancelled at random points and some bad:
    each ends as expected, the KV cache empties, and RSS grows by under 64 MiB after a warm-up."""
    rng = random.Random(7)

    async def one(stub: pb_grpc.InferenceStub, i: int) -> str:
        kind = rng.choices(["ok", "cancel", "bad"], [0.7, 0.2, 0.1])[0]
        if kind == "bad":
            try:
                async for _ in stub.Generate(build_request("x", top_p=0)):
                    pass
            except grpc.aio.AioRpcError as err:
                return "bad" if err.code() == INVALID else f"bad->{err.code().name}"
            return "bad accepted"
        n = rng.randint(4, 40)
        call = stub.Generate(build_request(f"soak {i}", max_tokens=n, temperature=0.8, seed=i, ignore_eos=True))
        cut = rng.randint(1, n) if kind == "cancel" else None
        got = 0
        async for chunk in call:
            got += len(chunk.token_ids)
            if cut is not None and got >= cut:
                call.cancel()
                return "cancel"
            if chunk.finish_reason:
                return "ok" if chunk.finish_reason == "length" and got == n else f"ok->{chunk.finish_reason}:{got}"
        return "cancel" if cut is not None else "ended early"

    async def round_(num: int) -> list[str]:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = pb_grpc.InferenceStub(channel)
            limit = asyncio.Semaphore(32)

            async def bounded(i: int) -> str:
                async with limit:
                    return await one(stub, i)

            return await asyncio.gather(*(bounded(i) for i in range(num)))

    asyncio.run(round_(64))  # warm-up
    assert server.wait_until(lambda: server.engine.block_manager.num_used_blocks == 0, timeout=30)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    outcomes = asyncio.run(round_(320))
    assert set(outcomes) <= {"ok", "cancel", "bad"}, sorted(set(outcomes))
    assert server.wait_until(lambda: server.engine.block_manager.num_used_blocks == 0
                             and not server.engine.has_unfinished_requests(), timeout=30)
    growth_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert growth_mib < 64, f"RSS grew {growth_mib:.0f} MiB"


def test_engine_limits_are_config_options(tiny_model_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, max_stop_strings=2,
                                    max_priority=3, max_prompt_chars=10))
    with pytest.raises(ValueError, match="stop: 3 strings, at most 2"):
        engine.add_request([1, 2], SamplingParams(stop=["a", "b", "c"]))
    with pytest.raises(ValueError, match=r"priority: 4 is outside \[-3, 3\]"):
        engine.add_request([1, 2], priority=4)
    with pytest.raises(ValueError, match="prompt: 11 characters, at most 10"):
        engine.add_request("x" * 11)
    assert not engine.has_unfinished_requests()
