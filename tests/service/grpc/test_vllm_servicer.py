"""Conformance of `vllm.grpc.engine.VllmEngine` (vLLM's engine gRPC contract), driven as a gateway
drives it: through the smg-grpc-proto package's own generated stubs, against a tiny-model server
that serves minivllm.v1.Inference on the same port. Every RPC is checked against the engine:
token-exact greedy output equal to minivllm.v1's for the same ids, KV events that replay to the
blocks the prefix cache holds, loads that move with load, abort and flush that free what they say."""
from __future__ import annotations

import asyncio
import hashlib
import io
import json
import threading
import zipfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc
from tokenizers import Tokenizer

from engine import EngineConfig
from service.grpc.minivllm_client import build_request
from service.observability.metrics import ServiceMetrics
from service.observability.tracing import Tracing, make_provider
from service.observability.wiring import MetricsInterceptor
from service.pb import inference_pb2_grpc as pb_grpc
from tests.server_harness import ServerThread, poll

VLLM = "vllm.grpc.engine.VllmEngine"
PROMPT = list(range(40, 40 + 4 * 7 + 2))  # seven full blocks of 4, then two tokens


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerThread]:
    metrics = ServiceMetrics("tiny")
    exporter = InMemorySpanExporter()
    srv = ServerThread(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256, block_size=4,
                                    max_num_batched_tokens=64, max_num_waiting=32),
                       observer=Tracing(make_provider(exporter, batch=False), "tiny"),
                       interceptors=[MetricsInterceptor(metrics)], served_model_name="tiny-served")
    srv.metrics, srv.spans = metrics, exporter
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def channel(server: ServerThread) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.target) as ch:
        yield ch


@pytest.fixture()
def stub(channel: grpc.Channel) -> vpb_grpc.VllmEngineStub:
    return vpb_grpc.VllmEngineStub(channel)


def _gen(prompt: list[int] | str, request_id: str = "", stream: bool = True, **sampling: object) -> vpb.GenerateRequest:
    req = vpb.GenerateRequest(request_id=request_id, stream=stream, sampling_params=vpb.SamplingParams(**sampling))
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.tokenized.CopyFrom(vpb.TokenizedInput(input_ids=prompt))
    return req


def _chunks_and_completes(responses: object) -> tuple[list[vpb.GenerateStreamChunk], list[vpb.GenerateComplete]]:
    chunks, completes = [], []
    for r in responses:
        (chunks if r.WhichOneof("response") == "chunk" else completes).append(getattr(r, r.WhichOneof("response")))
    return chunks, completes


def _idle(server: ServerThread) -> bool:
    e = server.engine
    return e.num_running == 0 and e.num_waiting == 0 and e.block_manager.num_used_blocks == 0


def test_greedy_stream_and_unary_equal_minivllm_v1_token_for_token(server: ServerThread, channel: grpc.Channel,
                                                                  stub: vpb_grpc.VllmEngineStub) -> None:
    ours = [t for r in pb_grpc.InferenceStub(channel).Generate(
        build_request(PROMPT, max_tokens=40, temperature=0, ignore_eos=True), timeout=60) for t in r.token_ids]
    assert len(ours) == 40
    chunks, completes = _chunks_and_completes(stub.Generate(
        _gen(PROMPT, "s1", max_tokens=40, temperature=0, ignore_eos=True), timeout=60))
    # vLLM's streamed shape: deltas in chunks, then the sample's complete repeats the last delta.
    assert [t for c in chunks for t in c.token_ids] == ours and len(chunks) > 1
    assert sum(c.completion_tokens for c in chunks) == 40 and {c.prompt_tokens for c in chunks} == {len(PROMPT)}
    (done,) = completes
    assert done.finish_reason == "length" and list(done.output_ids) == list(chunks[-1].token_ids)
    assert done.cached_tokens >= 4 * 7 and done.index == 0  # the prefix minivllm.v1's call left in the cache
    _, (whole,) = _chunks_and_completes(stub.Generate(
        _gen(PROMPT, stream=False, max_tokens=40, temperature=0, ignore_eos=True), timeout=60))
    assert list(whole.output_ids) == ours and whole.completion_tokens == 40 and whole.prompt_tokens == len(PROMPT)
    text = server.engine.tokenizer.decode(PROMPT)
    _, (from_text,) = _chunks_and_completes(stub.Generate(
        _gen(text, stream=False, max_tokens=8, temperature=0, ignore_eos=True), timeout=60))
    ids = server.engine.tokenize(text)
    assert list(from_text.output_ids) == [t for r in pb_grpc.InferenceStub(channel).Generate(
        build_request(ids, max_tokens=8, temperature=0, ignore_eos=True), timeout=60) for t in r.token_ids]


def test_sampling_params_stops_samples_logprobs_and_constraints(server: ServerThread, channel: grpc.Channel,
                                                              stub: vpb_grpc.VllmEngineStub) -> None:
    greedy = [t for r in pb_grpc.InferenceStub(channel).Generate(
        build_request(PROMPT, max_tokens=12, temperature=0, ignore_eos=True), timeout=60) for t in r.token_ids]
    stop_id = greedy[5]
    _, (done,) = _chunks_and_completes(stub.Generate(
        _gen(PROMPT, stream=False, max_tokens=12, temperature=0, stop_token_ids=[stop_id]), timeout=60))
    assert done.finish_reason == "stop" and done.matched_token_id == stop_id
    assert list(done.output_ids) == greedy[:greedy.index(stop_id) + 1]
    # Seeded sampling and n: sample i of a seeded request equals minivllm.v1's sample i.
    seeded = dict(max_tokens=10, temperature=0.9, seed=7, n=2, ignore_eos=True)
    theirs = {}
    for r in pb_grpc.InferenceStub(channel).Generate(build_request(PROMPT, **seeded), timeout=60):
        theirs.setdefault(r.index, []).extend(r.token_ids)
    chunks, completes = _chunks_and_completes(stub.Generate(_gen(PROMPT, **seeded), timeout=60))
    got = {i: [t for c in chunks if c.index == i for t in c.token_ids] for i in (0, 1)}
    assert got == theirs and sorted(c.index for c in completes) == [0, 1]
    # Logprobs: the sampled token's, and the top 3 (sampled first, as vLLM's lists are).
    chunks, (done,) = _chunks_and_completes(stub.Generate(
        _gen(PROMPT, max_tokens=6, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2), timeout=60))
    lp = [(t, v, list(top.token_ids)) for c in chunks for t, v, top in
          zip(c.output_logprobs.token_ids, c.output_logprobs.token_logprobs, c.output_logprobs.top_logprobs,
              strict=True)]
    assert [t for t, _, _ in lp] == greedy[:6] and all(v <= 0 and len(top) == 3 and top[0] == t for t, v, top in lp)
    first = chunks[0].input_logprobs
    assert list(first.token_ids) == PROMPT and not first.token_logprobs[0].HasField("value")
    assert all(v.HasField("value") for v in first.token_logprobs[1:])
    assert not any(c.HasField("input_logprobs") for c in chunks[1:])
    # logit_bias bans the greedy first token; a choice constraint yields one of the choices.
    _, (biased,) = _chunks_and_completes(stub.Generate(
        _gen(PROMPT, stream=False, max_tokens=1, temperature=0, logit_bias={greedy[0]: -100.0}), timeout=60))
    assert biased.output_ids[0] != greedy[0]
    _, (chose,) = _chunks_and_completes(stub.Generate(_gen(
        PROMPT, stream=False, max_tokens=20, temperature=0, choice=vpb.ChoiceConstraint(choices=["yes", "no"])),
        timeout=60))
    assert server.engine.tokenizer.decode(list(chose.output_ids), skip_special_tokens=True) in ("yes", "no")


@pytest.mark.parametrize(("request_", "code", "field"), [
    (vpb.GenerateRequest(request_id="e1", sampling_params=vpb.SamplingParams(max_tokens=4)),
     grpc.StatusCode.INVALID_ARGUMENT, "input"),
    (_gen([], "e2", max_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "tokenized.input_ids"),
    (_gen([5, 6], "e3", max_tokens=4, top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (_gen([5, 6], "e4", max_tokens=4, structural_tag="{}"), grpc.StatusCode.INVALID_ARGUMENT, "structural_tag"),
    (_gen([5, 6], "e5", max_tokens=100_000), grpc.StatusCode.RESOURCE_EXHAUSTED, "max_tokens"),
    (_gen([5, 100_000], "e6", max_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
])
def test_bad_requests_name_the_field(stub: vpb_grpc.VllmEngineStub, request_: vpb.GenerateRequest,
                                     code: grpc.StatusCode, field: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request_, timeout=30))
    assert err.value.code() == code and field in err.value.details()


def test_probes_model_server_info_and_tokenizer(server: ServerThread, channel: grpc.Channel,
                                                stub: vpb_grpc.VllmEngineStub, tiny_model_dir: Path) -> None:
    assert stub.HealthCheck(vpb.HealthCheckRequest(), timeout=10).healthy
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(service=VLLM), timeout=10).status == \
        health_pb2.HealthCheckResponse.SERVING
    info = stub.GetModelInfo(vpb.GetModelInfoRequest(), timeout=10)
    engine = server.engine
    assert (info.served_model_name, info.max_context_length, info.vocab_size) == \
        ("tiny-served", engine.max_model_len, engine.vocab_size)
    assert set(info.eos_token_ids) == engine.eos_token_ids and info.is_generation and not info.supports_vision
    hf_config = json.loads((tiny_model_dir / "config.json").read_text())
    assert info.model_type == "llama" and list(info.architectures) == hf_config.get("architectures", [])
    server_info = stub.GetServerInfo(vpb.GetServerInfoRequest(), timeout=10)
    assert server_info.server_type == "vllm-grpc" and server_info.block_size == 4
    assert server_info.data_parallel_size == 1 and server_info.max_num_seqs == engine.config.max_num_seqs
    chunks = list(stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=30))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest() and not any(c.sha256 for c in chunks[:-1])
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(archive.namelist())
        tokenizer = Tokenizer.from_str(archive.read("tokenizer.json").decode())
        assert json.loads(archive.read("config.json")) == json.loads((tiny_model_dir / "config.json").read_text())
    assert tokenizer.encode("The quick brown fox", add_special_tokens=False).ids == \
        engine.tokenize("The quick brown fox", add_special_tokens=False)
    for call, req in ((stub.Embed, vpb.EmbedRequest()), (stub.StartProfile, common_pb2.StartProfileRequest()),
                      (stub.StopProfile, common_pb2.StopProfileRequest())):
        with pytest.raises(grpc.RpcError) as err:
            call(req, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


class Subscriber:
    """A SubscribeKvEvents stream read on a thread, applied as a gateway's prefix index would."""

    def __init__(self, stub: vpb_grpc.VllmEngineStub, start: int = 0) -> None:
        self.blocks: dict[int, tuple[int, ...]] = {}
        self.last_sequence, self.loads = start, []
        self.call = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=start,
                                                                              load_records_before_first_batch=True))
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for batch in self.call:
                self.loads.append(batch.load)
                if batch.load.load_only:
                    continue
                assert batch.sequence_number == self.last_sequence + 1, "a gap or a repeat"
                for event in batch.events:
                    kind = event.WhichOneof("data")
                    if kind == "stored":
                        for block in event.stored.blocks:
                            self.blocks[block.block_hash] = tuple(block.token_ids)
                    elif kind == "removed":
                        for block_hash in event.removed.block_hashes:
                            del self.blocks[block_hash]
                    else:
                        self.blocks.clear()
                self.last_sequence = batch.sequence_number
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.CANCELLED

    def close(self) -> None:
        self.call.cancel()
        self.thread.join(10)


def test_kv_events_replay_to_the_cached_blocks_and_flush_clears_them(server: ServerThread,
                                                                      stub: vpb_grpc.VllmEngineStub) -> None:
    sub = Subscriber(stub)  # from 0: the whole history so far, then live batches
    try:
        for i in range(6):  # shared and distinct prefixes; the pool of 256 blocks is reused (removals)
            list(stub.Generate(_gen([3 + i % 2] * 12 + list(range(50 + 9 * i, 110 + 9 * i)), max_tokens=8,
                                    temperature=0, ignore_eos=True), timeout=60))
        assert poll(lambda: _idle(server), 10)
        hub = server.server.kv_events
        assert poll(lambda: sub.last_sequence == hub.last_sequence, 10)
        cached = server.engine.block_manager.cached_block_hashes()
        assert set(sub.blocks) == cached and len(cached) > 10
        # A second subscriber resuming from a cursor gets only what came after it.
        late = Subscriber(stub, start=hub.last_sequence)
        assert stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=10).success
        assert poll(lambda: sub.blocks == {} and late.last_sequence == hub.last_sequence, 10)
        assert server.engine.block_manager.cached_block_hashes() == set()
        assert poll(lambda: any(load.load_only for load in sub.loads), 5)  # load records while idle
        late.close()
    finally:
        sub.close()


def test_loads_move_with_load_and_flush_refuses_while_busy(server: ServerThread,
                                                          stub: vpb_grpc.VllmEngineStub) -> None:
    def load() -> vpb.SchedulerLoad:
        return stub.GetLoads(vpb.GetLoadsRequest(), timeout=10).loads[0]

    assert poll(lambda: _idle(server), 10)
    calls = [stub.Generate(_gen(PROMPT, f"load-{i}", max_tokens=400, temperature=0, ignore_eos=True), timeout=120)
             for i in range(6)]
    try:
        assert poll(lambda: load().num_running_reqs >= 2 and load().token_usage > 0, 30)
        busy = load()
        assert busy.num_total_reqs == busy.num_running_reqs + busy.num_waiting_reqs and busy.max_total_num_tokens
        flushed = stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=10)
        assert not flushed.success and "KV blocks" in flushed.message
    finally:
        for call in calls:
            call.cancel()
    assert poll(lambda: _idle(server), 10)
    list(stub.Generate(_gen([7, 8, 9], max_tokens=2, temperature=0), timeout=30))  # one more step after the cancels
    assert poll(lambda: load().num_running_reqs == 0 and load().token_usage == 0.0, 10)


def test_abort_by_request_id_ends_the_stream_and_frees_blocks(server: ServerThread,
                                                              stub: vpb_grpc.VllmEngineStub) -> None:
    responses = stub.Generate(_gen(PROMPT, "to-abort", max_tokens=900, temperature=0, ignore_eos=True), timeout=120)
    first = next(responses)
    assert first.chunk.token_ids
    assert server.engine.block_manager.num_used_blocks > 0
    stub.Abort(vpb.AbortRequest(request_ids=["to-abort", "unknown-id"]), timeout=10)
    chunks, completes = _chunks_and_completes(responses)
    assert completes[-1].finish_reason == "abort"
    assert sum(len(c.token_ids) for c in [first.chunk, *chunks]) < 900
    assert poll(lambda: _idle(server), 10)


def test_metrics_and_traces_name_the_vllm_door(server: ServerThread, stub: vpb_grpc.VllmEngineStub) -> None:
    list(stub.Generate(_gen(PROMPT, "traced", stream=False, max_tokens=3, temperature=0), timeout=30))
    value = server.metrics.registry.get_sample_value(
        "minivllm_api_requests_total",
        {"model_name": "tiny", "protocol": "grpc-vllm", "method": "Generate", "code": "OK"})
    assert value and value >= 1
    assert server.metrics.registry.get_sample_value(
        "minivllm_api_requests_total",
        {"model_name": "tiny", "protocol": "grpc-vllm", "method": "GetLoads", "code": "OK"}) is not None
    assert poll(lambda: any(s.attributes.get("gen_ai.response.id") == "traced" for s in server.spans.get_finished_spans()),
                5)
    span = next(s for s in server.spans.get_finished_spans() if s.attributes.get("gen_ai.response.id") == "traced")
    assert span.attributes["rpc.service"] == VLLM and span.attributes["gen_ai.usage.output_tokens"] == 3


def _kv_subscriptions(metrics: ServiceMetrics, code: str) -> float:
    return metrics.registry.get_sample_value("minivllm_api_requests_total", {
        "model_name": "tiny", "protocol": "grpc-vllm", "method": "SubscribeKvEvents", "code": code}) or 0.0


def test_a_kv_events_subscription_cancelled_in_its_replay_counts_as_cancelled(
        server: ServerThread, stub: vpb_grpc.VllmEngineStub) -> None:
    """The server-error alert counts UNKNOWN: a client's cancel is CANCELLED, whether it lands while
    the stream waits for an event (the handler's task is cancelled) or sits at a yield in the
    replay (its generator is closed: GeneratorExit)."""
    for i in range(4):  # a history to replay
        list(stub.Generate(_gen(list(range(60 + 13 * i, 100 + 13 * i)), max_tokens=4, temperature=0), timeout=60))
    assert server.server.kv_events.last_sequence > 3
    unknown, cancelled = _kv_subscriptions(server.metrics, "UNKNOWN"), _kv_subscriptions(server.metrics, "CANCELLED")
    for _ in range(10):
        call = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=0))
        next(call)  # the first batch of the replay
        call.cancel()
    assert poll(lambda: _kv_subscriptions(server.metrics, "CANCELLED") == cancelled + 10, 10)
    assert _kv_subscriptions(server.metrics, "UNKNOWN") == unknown


def test_the_metrics_interceptor_counts_a_stream_closed_at_a_yield_as_cancelled() -> None:
    """What grpc does when the client cancels while a server stream waits at a yield: it closes the
    stream's generator, so the handler sees GeneratorExit, not CancelledError."""
    metrics = ServiceMetrics("tiny")
    closed = []

    async def batches(request: object, context: object) -> AsyncIterator[int]:
        try:
            for i in range(100):
                yield i
        finally:
            closed.append(True)

    class Context:
        def code(self) -> None:
            return None

    async def run() -> None:
        async def continuation(details: object) -> grpc.RpcMethodHandler:
            return grpc.unary_stream_rpc_method_handler(batches)

        details = SimpleNamespace(method=f"/{VLLM}/SubscribeKvEvents")
        handler = await MetricsInterceptor(metrics).intercept_service(continuation, details)
        stream = handler.unary_stream(None, Context())
        assert await anext(stream) == 0
        await stream.aclose()

    asyncio.run(run())
    assert _kv_subscriptions(metrics, "CANCELLED") == 1 and _kv_subscriptions(metrics, "UNKNOWN") == 0
    assert closed == [True]  # the handler's own generator is closed at once, not left to the collector


def test_auth_drain_and_service_choice(tiny_model_dir: Path) -> None:
    srv = ServerThread(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, block_size=4),
                       auth_tokens=["sesame"], grpc_services=("vllm",))
    try:
        with grpc.insecure_channel(srv.target) as ch:
            stub = vpb_grpc.VllmEngineStub(ch)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(_gen([5, 6, 7], max_tokens=2), timeout=10))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            auth = [("authorization", "Bearer sesame")]
            assert len(list(stub.Generate(_gen([5, 6, 7], stream=False, max_tokens=2), timeout=10, metadata=auth))) == 1
            with pytest.raises(grpc.RpcError) as err:  # only the vLLM contract was asked for
                list(pb_grpc.InferenceStub(ch).Generate(build_request([5, 6], max_tokens=1), timeout=10, metadata=auth))
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
            srv.server.state.is_draining = True  # what the SIGTERM drain sets first
            reply = stub.HealthCheck(vpb.HealthCheckRequest(), timeout=10, metadata=auth)
            assert not reply.healthy and "draining" in reply.message
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(_gen([5, 6, 7], max_tokens=2), timeout=10, metadata=auth))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            srv.server.state.is_draining = False
    finally:
        srv.stop()
