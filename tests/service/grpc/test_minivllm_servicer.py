"""The gRPC service on 127.0.0.1 with the tiny model."""
from __future__ import annotations

import asyncio
import signal
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from service.grpc.minivllm_client import InferenceClient, build_request
from service.pb import inference_pb2 as pb
from service.pb import inference_pb2_grpc as pb_grpc
from service.server import InferenceServer, ServerConfig
from tests.server_harness import ServerProcess, ServerThread, poll

SERVICE = "minivllm.v1.Inference"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path):
    srv = ServerThread(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=1100, block_size=4,
                                    max_num_batched_tokens=128, max_num_waiting=64))
    yield srv
    srv.stop()


@pytest.fixture
def client(server: ServerThread):
    with InferenceClient(server.target, timeout=60) as c:
        yield c


def _idle(server: ServerThread) -> bool:
    e = server.engine
    return e.num_running == 0 and e.num_waiting == 0 and e.block_manager.num_used_blocks == 0


def test_stream_matches_offline_generate(server: ServerThread, client: InferenceClient, tiny_llm: LLM) -> None:
    prompt = "Hello world! Once upon a time"
    # 200 tokens: a stream's pending deltas leave as one message, so a few fast tiny-model steps
    # could all fit in the first.
    chunks = list(client.generate(prompt, max_tokens=200, temperature=0, ignore_eos=True))
    assert len(chunks) > 1  # really streamed
    offline = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))[0]
    assert "".join(c.text for c in chunks) == offline.text
    assert [t for c in chunks for t in c.token_ids] == offline.token_ids
    last = chunks[-1]
    assert last.finish_reason == "length" and last.usage.completion_tokens == 200
    assert last.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert all(not c.finish_reason for c in chunks[:-1])


def test_token_ids_chat_and_request_id(client: InferenceClient, tiny_llm: LLM) -> None:
    ids = tiny_llm.tokenizer.encode("The quick brown fox")
    text, out_ids, reason = client.complete(ids, max_tokens=5, temperature=0, ignore_eos=True)
    assert out_ids == tiny_llm.generate([ids], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].token_ids
    chunks = list(client.generate([{"role": "user", "content": "Hello"}], request_id="my-id", max_tokens=3))
    assert {c.request_id for c in chunks} == {"my-id"}
    assert chunks[-1].usage.prompt_tokens == len(tiny_llm.engine.apply_chat_template([{"role": "user",
                                                                                         "content": "Hello"}]))


def test_model_info_and_tokenize(client: InferenceClient, tiny_llm: LLM) -> None:
    info = client.model_info()
    assert info.vocab_size == tiny_llm.engine.vocab_size and info.max_model_len == 4096
    assert info.max_num_waiting == 64 and info.has_chat_template
    assert info.dtype == info.kv_cache_dtype == "torch.float32"  # the pool follows the model unless set
    assert client.tokenize("Hello world") == tiny_llm.tokenizer.encode("Hello world")


async def _run_concurrent(target: str, n: int) -> list[list[pb.GenerateResponse]]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceStub(channel)

        async def one(i: int) -> list[pb.GenerateResponse]:
            return [r async for r in stub.Generate(build_request(f"Stream {i} says", max_tokens=12 + i % 5,
                                                                 temperature=0.8, seed=i, ignore_eos=True))]

        return await asyncio.gather(*(one(i) for i in range(n)))


def test_32_concurrent_streams_all_finish(server: ServerThread) -> None:
    results = asyncio.run(_run_concurrent(server.target, 32))
    assert len(results) == 32
    for i, chunks in enumerate(results):
        assert chunks[-1].finish_reason == "length"
        assert sum(len(c.token_ids) for c in chunks) == 12 + i % 5
    assert server.wait_until(lambda: _idle(server))


@pytest.mark.parametrize("request_kwargs, field", [
    ({"prompt": "hi", "sampling": pb.SamplingParams(temperature=-1)}, "temperature"),
    ({"prompt": "hi", "sampling": pb.SamplingParams(top_p=0)}, "top_p"),
    ({"prompt": "hi", "sampling": pb.SamplingParams(max_tokens=0)}, "max_tokens"),
    ({"prompt": "hi", "sampling": pb.SamplingParams(logprobs=99)}, "logprobs"),
    ({"prompt": "hi", "sampling": pb.SamplingParams(min_tokens=9, max_tokens=2)}, "min_tokens"),
    ({"prompt": "hi", "sampling": pb.SamplingParams(stop=[""])}, "stop"),
    ({"prompt": ""}, "prompt"),
    ({}, "input"),
    ({"prompt_token_ids": pb.TokenIds(ids=[1, 999999])}, "prompt_token_ids"),
    ({"prompt_token_ids": pb.TokenIds(ids=[])}, "prompt_token_ids"),
    ({"messages": pb.Messages(messages=[pb.ChatMessage(role="wizard", content="x")])}, "role"),
    ({"messages": pb.Messages(messages=[])}, "messages"),
    ({"prompt": "hi", "sampling": pb.SamplingParams(stop_token_ids=[10**6])}, "stop_token_ids"),
])
def test_bad_input_is_invalid_argument(server: ServerThread, request_kwargs: dict, field: str) -> None:
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(**request_kwargs), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    with InferenceClient(server.target, timeout=30) as c:  # and the server still serves
        assert c.complete("still alive", max_tokens=2)[2] == "length"


def test_prompt_too_long_is_resource_exhausted(client: InferenceClient) -> None:
    with pytest.raises(grpc.RpcError) as err:
        client.complete([5] * 4096, max_tokens=2)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "prompt" in err.value.details()


def test_queue_full_is_resource_exhausted(tiny_model_dir: Path) -> None:
    srv = ServerThread(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256, max_num_seqs=1,
                                    max_num_waiting=1))
    try:
        with grpc.insecure_channel(srv.target) as channel:
            stub = pb_grpc.InferenceStub(channel)
            long_req = build_request("x", max_tokens=3000, ignore_eos=True)
            running = stub.Generate(long_req)
            next(running)  # first token: it holds the only running slot
            waiting = stub.Generate(long_req)
            assert srv.wait_until(lambda: srv.engine.num_waiting == 1)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(build_request("y", max_tokens=2), timeout=30))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "waiting" in err.value.details()
            running.cancel()
            waiting.cancel()
        assert srv.wait_until(lambda: _idle(srv))
    finally:
        srv.stop()


def test_cancel_mid_stream_frees_everything(server: ServerThread) -> None:
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        call = stub.Generate(build_request("cancel me", max_tokens=3000, ignore_eos=True))
        next(call)
        assert server.engine.num_running == 1 and server.engine.block_manager.num_used_blocks > 0
        call.cancel()
    assert server.wait_until(lambda: _idle(server))


def test_deadline_aborts_in_engine(server: ServerThread) -> None:
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(build_request("slow", max_tokens=4000, ignore_eos=True), timeout=0.5))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert server.wait_until(lambda: _idle(server))


def test_engine_fault_is_internal_and_server_keeps_serving(server: ServerThread, client: InferenceClient) -> None:
    runner = server.engine.runner
    original = runner.execute

    def boom(*args: object) -> None:
        runner.execute = original
        raise RuntimeError("injected fault")

    runner.execute = boom
    with pytest.raises(grpc.RpcError) as err:
        client.complete("fail me", max_tokens=4)
    assert err.value.code() == grpc.StatusCode.INTERNAL and "injected fault" in err.value.details()
    assert client.complete("after the fault", max_tokens=3)[2] == "length"
    assert server.wait_until(lambda: _idle(server))


def test_health_not_serving_while_loading(tiny_model_dir: Path) -> None:
    release = threading.Event()
    config = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64)

    def slow_factory() -> LLMEngine:
        release.wait(30)
        return LLMEngine(config)

    srv = ServerThread(config, engine_factory=slow_factory, wait_ready=False)
    try:
        with grpc.insecure_channel(srv.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", SERVICE):
                resp = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
                assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as err:
                list(pb_grpc.InferenceStub(channel).Generate(build_request("hi"), timeout=10))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in err.value.details()
            release.set()
            assert srv.wait_until(lambda: health.Check(health_pb2.HealthCheckRequest(service=SERVICE)).status
                                  == health_pb2.HealthCheckResponse.SERVING, timeout=60)
    finally:
        release.set()
        srv.stop()


def test_engine_is_built_on_the_thread_that_steps_it(tiny_model_dir: Path) -> None:
    # One OpenMP team in the process: a model loaded on one thread and stepped on another makes
    # two, and libgomp then throttles their spin-waits (the steps ran 10-15 % slower).
    config = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64)
    built_on, stepped_on = [], set()

    def factory() -> LLMEngine:
        built_on.append(threading.get_ident())
        return LLMEngine(config)

    srv = ServerThread(config, stats_listeners=[lambda stats: stepped_on.add(threading.get_ident())],
                       engine_factory=factory)
    try:
        with InferenceClient(srv.target, timeout=60) as c:
            assert c.complete("hello", max_tokens=3, ignore_eos=True)[2] == "length"
        # One build, on the thread every step ran on, and not on the event loop's thread.
        assert len(built_on) == 1 and stepped_on == set(built_on) and built_on[0] != srv.loop_thread_id
    finally:
        srv.stop()


def test_engine_factory_error_fails_start(tiny_model_dir: Path) -> None:
    def broken() -> LLMEngine:
        raise ValueError("model: no such checkpoint")

    async def main() -> None:
        server = InferenceServer(ServerConfig(host="127.0.0.1", port=0, engine=EngineConfig(model=str(tiny_model_dir))))
        try:
            with pytest.raises(ValueError, match="no such checkpoint"):
                await server.start(broken)
            assert server.async_engine is None and server.state.engine is None
        finally:
            await server.server.stop(None)

    asyncio.run(main())


def test_reflection_lists_the_service(server: ServerThread) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(server.target) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = db.get_services()
        assert SERVICE in services and "grpc.health.v1.Health" in services
        desc = db.FindFileContainingSymbol(SERVICE)
        assert any(s.name == "Inference" for s in desc.service)


def _health(channel: grpc.Channel) -> int | None:
    try:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE),
                                                         timeout=5).status
    except grpc.RpcError:
        return None


def test_sigterm_drains_in_flight_stream(tiny_model_dir: Path, tmp_path: Path) -> None:
    server = ServerProcess(tiny_model_dir, "--num-kv-blocks", "512")
    try:
        with grpc.insecure_channel(server.target) as channel:
            assert poll(lambda: _health(channel) == health_pb2.HealthCheckResponse.SERVING, 120), \
                "server did not become healthy"
            stub = pb_grpc.InferenceStub(channel)
            stream = stub.Generate(build_request("drain me", max_tokens=2500, ignore_eos=True))
            first = next(stream)
            server.proc.send_signal(signal.SIGTERM)
            assert poll(lambda: _health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING, 10)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(build_request("too late", max_tokens=2), timeout=5))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            rest = list(stream)
            assert rest[-1].finish_reason == "length"
            assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == 2500
        assert server.proc.wait(60) == 0
    finally:
        server.close()
    assert "draining" in server.output and "server stopped" in server.output
