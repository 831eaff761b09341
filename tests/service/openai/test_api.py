"""The OpenAI-compatible HTTP front door, driven by the official `openai` SDK (and raw HTTP where
the SDK hides what is checked: disconnects, error bodies)."""
from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from bench.serving import main as bench_main
from engine import EngineConfig, LLMEngine, SamplingParams
from service.grpc.minivllm_client import InferenceClient
from service.observability.metrics import ServiceMetrics
from service.observability.tracing import Tracing, make_provider
from service.openai.api import OpenAIFrontDoor
from service.openai.http_server import HttpServer
from service.pb import inference_pb2 as pb
from service.serving_state import ServingState
from tests.server_harness import ServerThread, poll

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerThread]:
    metrics = ServiceMetrics(MODEL)
    exporter = InMemorySpanExporter()
    srv = ServerThread(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256, block_size=4),
                       stats_listeners=[metrics.on_step], observer=Tracing(make_provider(exporter, batch=False), MODEL),
                       http_port=0, served_model_name=MODEL, on_http_call=metrics.on_api_call)
    srv.metrics, srv.spans = metrics, exporter
    yield srv
    srv.stop()


@pytest.fixture()
def client(server: ServerThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _grpc_greedy(server: ServerThread, prompt: object, max_tokens: int) -> tuple[str, list[int]]:
    with InferenceClient(server.target) as c:
        text, ids, _ = c.complete(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return text, ids


def test_models_and_health(server: ServerThread, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]

    with urllib.request.urlopen(server.http_url + "/health", timeout=10) as resp:
        assert resp.status == 200 and json.load(resp) == {"status": "ok"}


def test_completion_matches_grpc_whole_and_streamed(server: ServerThread, client: openai.OpenAI) -> None:
    expected, ids = _grpc_greedy(server, "the quick brown fox", 12)
    whole = client.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12 == len(ids) and whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    chunks = list(client.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    # Token ids as the prompt give the same answer as the text they encode.
    by_ids = client.completions.create(model=MODEL, prompt=ids[:3], max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == _grpc_greedy(server, ids[:3], 4)[0]


def test_chat_stream_and_whole_agree_with_usage(server: ServerThread, client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    expected, _ = _grpc_greedy(server, messages, 10)
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content == expected
    with InferenceClient(server.target) as c:
        num_prompt = len(c.stub.Tokenize(pb.TokenizeRequest(messages=pb.Messages(
            messages=[pb.ChatMessage(**m) for m in messages]))).token_ids)
    assert whole.usage.prompt_tokens == num_prompt and whole.usage.completion_tokens == 10
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == num_prompt
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")


def test_stop_string_and_seeded_sampling(server: ServerThread, client: openai.OpenAI) -> None:
    text, _ = _grpc_greedy(server, "abc def", 16)
    stop = text[4:7]
    if not stop.strip():
        pytest.skip("greedy text too short to pick a stop string")
    out = client.completions.create(model=MODEL, prompt="abc def", max_tokens=16, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "stop" and out.choices[0].text == text[:text.index(stop)]
    a, b = (client.completions.create(model=MODEL, prompt="abc", max_tokens=8, temperature=1.0, seed=7)
            for _ in range(2))
    assert a.choices[0].text == b.choices[0].text


def test_logprobs_have_token_text(server: ServerThread, client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                         temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    joined = "".join(e.token for e in content)
    assert len(content) == 5 and ("\ufffd" in joined or joined == out.choices[0].message.content)
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and entry.logprob == pytest.approx(values[0])  # greedy
        assert bytes(entry.bytes).decode() == entry.token
    comp = client.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=0, logprobs=2,
                                     extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    # Each token's text is its id decoded alone (ids from the gRPC answer to the same greedy request).
    _, ids = _grpc_greedy(server, "hi", 4)
    tokenizer = server.engine.input_processor.tokenizer
    assert lp.tokens == [tokenizer.decode([i]) for i in ids] and len(lp.token_logprobs) == 4
    assert all(len(t) <= 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0


@pytest.mark.parametrize(("body", "param"), [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"n": 0}, "n"),
    ({"n": 500}, "n"),
    ({"top_p": 0}, "top_p"),
    ({"stop": [""]}, "stop"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt[1]"),
    ({"prompt": ["a"] * 129}, "prompt"),
    ({"prompt": [10**9]}, "prompt_token_ids"),
])
def test_bad_requests_are_400_in_openai_shape(client: openai.OpenAI, body: dict, param: str) -> None:
    request = {"model": MODEL, "prompt": "x", "max_tokens": 2} | body
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**request)
    error = info.value.body
    assert info.value.status_code == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == param or param in error["message"], error


def _post(server: ServerThread, path: str, body: bytes | dict) -> tuple[int, dict]:
    """POST a raw or JSON body; the status and the decoded reply, errors included."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"{server.http_url}{path}", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_malformed_bodies_name_the_field_or_the_json_error(server: ServerThread) -> None:
    status, body = _post(server, "/v1/chat/completions", b'{"messages": [')
    assert status == 400 and body["error"]["param"] is None and "not valid JSON" in body["error"]["message"], body
    status, body = _post(server, "/v1/chat/completions", {"messages": [{"role": 5, "content": "x"}], "max_tokens": 2})
    assert status == 400 and body["error"]["param"] == "messages[0].role", body
    status, body = _post(server, "/v1/completions", {"prompt": ["text", [1, 2]], "max_tokens": 2})
    assert status == 400 and body["error"]["param"] == "prompt", body  # not "prompt.str", pydantic's union member


def test_tokenize_and_detokenize_as_vllm(server: ServerThread, client: openai.OpenAI) -> None:
    text = "The quick brown fox jumps over the lazy dog"
    status, tokens = _post(server, "/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True})
    assert status == 200, tokens
    used = client.completions.create(model=MODEL, prompt=text, max_tokens=1).usage.prompt_tokens
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"]) == used
    assert tokens["max_model_len"] == server.engine.model_info().max_model_len
    tokenizer = server.engine.input_processor.tokenizer
    assert tokens["tokens"] == tokenizer.encode(text)  # add_special_tokens defaults to true, as in vLLM
    assert tokens["token_strs"] == tokenizer.convert_ids_to_tokens(tokens["tokens"])
    assert _post(server, "/detokenize", {"tokens": tokens["tokens"]}) == (200, {"prompt": text})
    chat = [{"role": "user", "content": "hi there"}]
    status, chat_tokens = _post(server, "/tokenize", {"messages": chat})
    used = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=1).usage.prompt_tokens
    assert status == 200 and chat_tokens["count"] == used, chat_tokens
    with urllib.request.urlopen(f"{server.http_url}/tokenizer_info", timeout=30) as resp:
        info = json.loads(resp.read())
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] == tokenizer.chat_template, info
    status, plain = _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert status == 200 and plain["tokens"] == tokenizer.encode(text, add_special_tokens=False), plain
    for path, body, code, param in (("/tokenize", {"prompt": "x", "messages": chat}, 400, "prompt"),
                                    ("/tokenize", {}, 400, "prompt"),
                                    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
                                    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
                                    ("/detokenize", {"tokens": "abc"}, 400, "tokens")):
        status, error = _post(server, path, body)
        assert status == code and error["error"]["param"] == param, (path, body, error)


def test_echo_scores_a_prompt_as_lm_eval_harness_reads_it(server: ServerThread, client: openai.OpenAI) -> None:
    """lm-evaluation-harness's local-completions scores a text with echo, logprobs 1 and max_tokens 1,
    then reads token_logprobs[context:-1] and checks each against max(top_logprobs)."""
    text = "the quick brown fox jumps"
    prompt_ids = _post(server, "/tokenize", {"prompt": text})[1]["tokens"]
    scored = client.completions.create(model=MODEL, prompt=text, max_tokens=1, temperature=0, logprobs=1, echo=True)
    choice = scored.choices[0]
    lp = choice.logprobs
    n = len(prompt_ids)
    assert choice.text.startswith(text), choice.text
    assert scored.usage.prompt_tokens == n and len(lp.token_logprobs) == len(lp.tokens) == n + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and "".join(lp.tokens[:n]) == text
    assert lp.text_offset[n] == len(text) and lp.text_offset == sorted(lp.text_offset)
    # The same scores as the engine's prompt_logprobs (vLLM's layout, keyed by token id).
    reference = client.completions.create(model=MODEL, prompt=text, max_tokens=1, temperature=0,
                                          extra_body={"prompt_logprobs": 1})
    ref = reference.model_extra.get("prompt_logprobs") or reference.choices[0].model_extra["prompt_logprobs"]
    for i in range(1, n):
        assert lp.token_logprobs[i] == pytest.approx(ref[i][str(prompt_ids[i])]["logprob"], abs=1e-5)
        best = max(v["logprob"] for v in ref[i].values())
        assert max(lp.top_logprobs[i].values()) == pytest.approx(best, abs=1e-5)
    assert "prompt_logprobs" not in (choice.model_extra or {})  # not asked for
    # Streamed: the prompt comes first, then the same tokens.
    chunks = list(client.completions.create(model=MODEL, prompt=text, max_tokens=3, temperature=0, logprobs=1,
                                            echo=True, stream=True))
    whole = client.completions.create(model=MODEL, prompt=text, max_tokens=3, temperature=0, logprobs=1, echo=True)
    assert chunks[0].choices[0].text == text
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == whole.choices[0].logprobs.token_logprobs
    assert [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset] == \
        whole.choices[0].logprobs.text_offset
    # Every sample starts with the prompt; token ids are echoed as their text.
    several = client.completions.create(model=MODEL, prompt=text, max_tokens=2, temperature=1.0, n=2, echo=True)
    assert [c.text.startswith(text) for c in several.choices] == [True, True]
    by_ids = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=2, temperature=0, echo=True)
    assert by_ids.choices[0].text == whole.choices[0].text[:len(by_ids.choices[0].text)]
    assert by_ids.choices[0].text.startswith(text)


def test_a_batch_of_prompts_is_one_request_each(server: ServerThread, client: openai.OpenAI) -> None:
    """OpenAI's and vLLM's numbering: choice i * n + j is sample j of prompt i; usage counts every
    prompt once; streamed and whole agree; a refused prompt ends the ones admitted before it."""
    prompts = ["the quick brown fox", "jumps over the lazy dog"]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True}) for p in prompts]
    both = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0, n=2,
                                     extra_body={"ignore_eos": True})
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2
    assert both.usage.prompt_tokens == alone[0].usage.prompt_tokens + alone[1].usage.prompt_tokens
    assert both.usage.completion_tokens == 16
    chunks = list(client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0, n=2,
                                            stream=True, extra_body={"ignore_eos": True}))
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(4)]
    assert streamed == [c.text for c in both.choices]
    echoed = client.completions.create(model=MODEL, prompt=["a b c", "x y"], max_tokens=2, temperature=0, echo=True,
                                       logprobs=1)
    assert echoed.choices[0].text.startswith("a b c") and echoed.choices[1].text.startswith("x y")
    for choice, prompt in zip(echoed.choices, ["a b c", "x y"], strict=True):
        num_prompt = len(_post(server, "/tokenize", {"prompt": prompt})[1]["tokens"])
        lp = choice.logprobs
        assert lp.token_logprobs[0] is None and "".join(lp.tokens[:num_prompt]) == prompt
        assert len(lp.tokens) == num_prompt + 2 and lp.text_offset[num_prompt] == len(prompt)
    def num_aborted() -> float:
        return server.metrics.registry.get_sample_value(
            "minivllm_requests_finished_total", {"model_name": MODEL, "finish_reason": "abort"}) or 0

    aborted_before = num_aborted()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[[5, 6, 7], [10**9]], max_tokens=1000,
                                  extra_body={"ignore_eos": True})
    assert info.value.body["param"] == "prompt_token_ids"
    assert poll(lambda: not server.engine.has_unfinished_requests(), 30)
    assert poll(lambda: num_aborted() == aborted_before + 1, 10), "the admitted prompt was not aborted"


def test_a_stream_closed_unread_ends_its_request(server: ServerThread) -> None:
    """Closing an async generator that never started runs none of its code: the request kept
    running and its id stayed in use. The engine's stream ends it either way."""
    async def admit_and_drop() -> None:
        stream = await server.server.async_engine.generate("unread", SamplingParams(max_tokens=1000, ignore_eos=True),
                                                           prompt=[5, 6, 7])
        await stream.aclose()

    for _ in range(2):  # the second admission would find the id still in use
        asyncio.run_coroutine_threadsafe(admit_and_drop(), server.loop).result(30)
        assert poll(lambda: not server.engine.has_unfinished_requests(), 30), "the unread request kept running"


def test_wrong_model_is_404_and_missing_field_400(server: ServerThread, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    assert info.value.body["param"] == "messages"


def _raw_post(port: int, path: str, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees_kv(server: ServerThread, stream: bool) -> None:
    finished_before = server.metrics.registry.get_sample_value(
        "minivllm_requests_finished_total", {"model_name": MODEL, "finish_reason": "abort"}) or 0
    sock = _raw_post(server.server.http.port, "/v1/completions",
                     {"prompt": "a long story", "max_tokens": 1000, "ignore_eos": True, "stream": stream})
    assert poll(lambda: server.engine.num_running + server.engine.num_waiting == 1, 30)
    if stream:
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    sock.close()
    assert poll(lambda: not server.engine.has_unfinished_requests(), 30), "the request was not aborted"
    assert server.engine.block_manager.count_referenced_blocks() == 0  # its KV blocks are free again
    assert poll(lambda: (server.metrics.registry.get_sample_value(
        "minivllm_requests_finished_total", {"model_name": MODEL, "finish_reason": "abort"}) or 0)
        == finished_before + 1, 10)


def test_http_calls_are_metered_and_traced(server: ServerThread, client: openai.OpenAI) -> None:
    server.spans.clear()
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "trace"}], max_tokens=3,
                                   temperature=0.5, extra_headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=-1)
    assert poll(lambda: len([s for s in server.spans.get_finished_spans() if s.kind is SpanKind.SERVER]) == 2, 10)
    spans = sorted((s for s in server.spans.get_finished_spans() if s.kind is SpanKind.SERVER), key=lambda s: s.name)
    ok, bad = spans[0], spans[1]
    assert ok.name == f"chat {MODEL}" and format(ok.context.trace_id, "032x") == trace_id
    assert ok.attributes["http.route"] == "/v1/chat/completions" and ok.attributes["http.response.status_code"] == 200
    assert ok.attributes["gen_ai.response.id"].startswith("chatcmpl-") and ok.attributes["gen_ai.usage.output_tokens"] == 3
    assert bad.attributes["error.type"] == "400" and bad.attributes["http.route"] == "/v1/completions"
    value = server.metrics.registry.get_sample_value
    labels = {"model_name": MODEL, "protocol": "http"}
    assert value("minivllm_api_requests_total", labels | {"method": "/v1/chat/completions", "code": "200"}) >= 1
    assert value("minivllm_api_requests_total", labels | {"method": "/v1/completions", "code": "400"}) >= 1


def test_auth_and_body_limit(tiny_model_dir: Path) -> None:
    srv = ServerThread(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64), http_port=0,
                       served_model_name=MODEL, auth_tokens=["s3cret"], max_message_bytes=2048)
    try:
        with openai.OpenAI(base_url=srv.http_url + "/v1", api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
        with openai.OpenAI(base_url=srv.http_url + "/v1", api_key="s3cret", max_retries=0) as good:
            assert good.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens >= 1
            with pytest.raises(openai.APIStatusError) as info:
                good.completions.create(model=MODEL, prompt="x" * 4096, max_tokens=2)
            assert info.value.status_code == 413
        import urllib.request

        with urllib.request.urlopen(srv.http_url + "/health", timeout=10) as resp:  # health stays open
            assert resp.status == 200
    finally:
        srv.stop()


def test_drain_refuses_new_http_calls_and_finishes_running(tiny_model_dir: Path) -> None:
    """The server's own drain (what SIGTERM runs) starts while a stream runs: a new call gets 503,
    the running stream still ends with its finish reason, and then the server stops."""
    config = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256)

    def slow_engine() -> LLMEngine:
        """Steps of at least 10 ms: the tiny model makes 300 tokens in about 50 ms, so the answer
        would be whole (its outputs merged into the first event) before the drain began."""
        engine = LLMEngine(config)
        step = engine.step
        engine.step = lambda: (time.sleep(0.01), step())[1]
        return engine

    srv = ServerThread(config, http_port=0, served_model_name=MODEL, engine_factory=slow_engine)
    with openai.OpenAI(base_url=srv.http_url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
        stream = c.completions.create(model=MODEL, prompt="drain", max_tokens=100, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
        first = next(iter(stream))
        drain = asyncio.run_coroutine_threadsafe(srv.server.drain_and_stop(), srv.loop)
        assert poll(lambda: srv.server.state.is_draining, 10)
        with pytest.raises(openai.APIStatusError) as info:
            c.completions.create(model=MODEL, prompt="late", max_tokens=2)
        assert info.value.status_code == 503
        rest = list(stream)
    drain.result(30)
    assert srv.join(30)  # the drain stopped the server: no stop() here, its loop has ended
    assert first.choices[0].text is not None and [first, *rest][-1].choices[0].finish_reason == "length"


def test_bench_openai_backend_against_our_server(server: ServerThread, tmp_path: Path) -> None:
    vocab = server.engine.model_info().vocab_size
    bench_main(["--backend", "openai", "--base-url", server.http_url, "--model", MODEL, "--workload", "random",
                "--num-requests", "6", "--input-len", "16", "--output-len", "8", "--concurrency", "3",
                "--vocab-size", str(min(vocab, 300)), "--result-dir", str(tmp_path), "--no-progress"])
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["completed"] == 6 and result["failed"] == 0 and result["total_output_tokens"] == 6 * 8


def test_http_port_taken_is_an_oserror_not_an_exit() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            HttpServer(OpenAIFrontDoor(ServingState(), MODEL).asgi, "127.0.0.1", taken.getsockname()[1])


def test_grpc_still_serves_beside_http(server: ServerThread) -> None:
    with grpc.insecure_channel(server.target) as channel:
        grpc.channel_ready_future(channel).result(timeout=10)
    assert _grpc_greedy(server, "x", 2)[1]


def test_structured_output_logit_bias_and_prompt_logprobs(server: ServerThread, client: openai.OpenAI) -> None:
    import re

    schema = {"type": "object", "properties": {"c": {"enum": ["yes", "no"]}}, "required": ["c"],
              "additionalProperties": False}
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "answer"}], max_tokens=400, temperature=0.9, seed=4,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert json.loads(out.choices[0].message.content)["c"] in ("yes", "no"), out.choices[0].message.content
    # vLLM's completions take response_format too; ignoring it would return free text.
    text = client.completions.create(
        model=MODEL, prompt="answer", max_tokens=400, temperature=0.9, seed=4,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}
    ).choices[0].text
    assert json.loads(text)["c"] in ("yes", "no"), text
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                  extra_body={"response_format": {"type": "json_object"}, "guided_regex": "a+"})
    assert info.value.body["param"] == "guided_regex" and "response_format" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                  extra_body={"response_format": {"type": "xml"}, "guided_regex": "a+"})
    assert info.value.body["param"] == "response_format", info.value.body
    regex = r"[0-9]{3}-[a-z]{2,5}"
    for extra in ({"structured_outputs": {"regex": regex}}, {"guided_regex": regex}):
        text = client.completions.create(model=MODEL, prompt="code:", max_tokens=30, temperature=1.0,
                                         extra_body=extra).choices[0].text
        assert re.fullmatch(regex, text), text
    picked = client.completions.create(model=MODEL, prompt="pick", max_tokens=10, temperature=1.0,
                                       extra_body={"structured_outputs": {"choice": ["red", "blue"]}})
    assert picked.choices[0].text in ("red", "blue")
    forced = client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0, logit_bias={"9": 100},
                                       logprobs=0, extra_body={"ignore_eos": True})
    tokenizer = server.engine.input_processor.tokenizer
    assert forced.choices[0].logprobs.tokens == [tokenizer.decode([9])] * 3
    scored = client.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=1, temperature=0,
                                       extra_body={"prompt_logprobs": 1})
    prompt_logprobs = scored.model_extra.get("prompt_logprobs") or scored.choices[0].model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == scored.usage.prompt_tokens
    assert all(any(v["rank"] == 1 for v in entry.values()) for entry in prompt_logprobs[1:])
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       response_format={"type": "xml"})
    assert info.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                  extra_body={"structured_outputs": {"json": {"type": "objekt"}}})
    assert info.value.body["param"] == "structured_outputs.json", info.value.body  # the request's field, not the engine's
