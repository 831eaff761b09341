"""POST /v1/embeddings through the official `openai` SDK: vectors equal sentence-transformers'
encode() on a tiny random Qwen3 embedder, for every input form and both encodings; bad input
named by field; pooling requests counted apart from generation's."""
from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest

from engine import EngineConfig
from service.observability.metrics import ServiceMetrics
from tests.helpers import cosines
from tests.server_harness import ServerThread, poll
from tests.tiny_model import build_tiny_embedding_model

MODEL = "tiny-embed"
TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog. " * 6, "Unicode: café, 你好"]


@pytest.fixture(scope="module")
def embedding_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_embedding_model(tmp_path_factory.mktemp("embedder") / "lasttoken")


@pytest.fixture(scope="module")
def reference(embedding_dir: Path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(embedding_dir), device="cpu")


@pytest.fixture(scope="module")
def server(embedding_dir: Path) -> Iterator[ServerThread]:
    metrics = ServiceMetrics(MODEL)
    srv = ServerThread(EngineConfig(model=str(embedding_dir), num_kv_blocks=128, block_size=4,
                                    max_num_batched_tokens=16),
                       stats_listeners=[metrics.on_step], http_port=0, served_model_name=MODEL,
                       on_http_call=metrics.on_api_call)
    srv.metrics = metrics
    yield srv
    srv.stop()


@pytest.fixture()
def client(server: ServerThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _post(server: ServerThread, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(server.http_url + "/v1/embeddings", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


@pytest.mark.parametrize("encoding_format", [None, "float", "base64"])
def test_texts_equal_sentence_transformers(client: openai.OpenAI, reference, encoding_format: str | None) -> None:
    """A batch of texts (one chunked over several steps), in order, with usage. Unasked, the SDK
    asks for base64 and decodes it itself; asked for base64, it hands the strings over."""
    kwargs = {} if encoding_format is None else {"encoding_format": encoding_format}
    result = client.embeddings.create(model=MODEL, input=TEXTS, **kwargs)
    if encoding_format == "base64":
        assert all(isinstance(d.embedding, str) for d in result.data)
        got = np.array([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in result.data])
    else:
        got = np.array([d.embedding for d in result.data])
    assert [d.index for d in result.data] == list(range(len(TEXTS)))
    assert cosines(got, reference.encode(TEXTS)).min() >= 0.9999
    num_tokens = sum(len(reference.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert result.usage.prompt_tokens == result.usage.total_tokens == num_tokens
    assert result.model == MODEL


def test_every_input_form(server: ServerThread, client: openai.OpenAI, reference) -> None:
    """A string, token ids and a list of token-id lists are the same vectors as their texts'."""
    expected = reference.encode(TEXTS)
    ids = [reference.tokenizer(t)["input_ids"] for t in TEXTS]
    one = client.embeddings.create(model=MODEL, input=TEXTS[0])
    assert cosines(np.array([one.data[0].embedding]), expected[:1]).min() >= 0.9999
    as_ids = client.embeddings.create(model=MODEL, input=ids[1])
    assert cosines(np.array([as_ids.data[0].embedding]), expected[1:2]).min() >= 0.9999
    status, body = _post(server, {"model": MODEL, "input": ids})  # raw: the float encoding on the wire
    assert status == 200
    assert cosines(np.array([d["embedding"] for d in body["data"]]), expected).min() >= 0.9999


def test_dimensions(client: openai.OpenAI, reference) -> None:
    result = client.embeddings.create(model=MODEL, input=TEXTS, dimensions=16)
    got = np.array([d.embedding for d in result.data])
    assert got.shape == (len(TEXTS), 16)
    expected = reference.encode(TEXTS, truncate_dim=16, normalize_embeddings=True)
    assert cosines(got, expected).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-5)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": ["ok", ""]}, "input[1]"),
    ({"input": [[1, 2], []]}, "input[1]"),
    ({"input": [5, 100000]}, "input"),
    ({"input": ["ok", [1, 100000]]}, "input"),  # mixed forms: refused by the body's schema
    ({"input": ["ok", "fine"], "encoding_format": "int8"}, "encoding_format"),
    ({"input": "ok", "dimensions": 0}, "dimensions"),
    ({"input": "ok", "dimensions": 65}, "dimensions"),
    ({"input": "ok", "model": "other"}, "model"),
])
def test_bad_input_named_by_field(server: ServerThread, body: dict, param: str) -> None:
    status, answer = _post(server, {"model": MODEL, **body})
    assert status == (404 if param == "model" else 400), answer
    assert answer["error"]["param"] == param, answer


def test_token_ids_out_of_vocabulary_in_a_batch(server: ServerThread) -> None:
    status, answer = _post(server, {"model": MODEL, "input": [[1, 2], [3, 100000]]})
    assert status == 400 and answer["error"]["param"] == "input[1]" and "100000" in answer["error"]["message"]


def test_generation_refused_on_an_embedding_model(client: openai.OpenAI) -> None:
    """Every generation route, the Responses API's too (its model would generate from a tied head)."""
    calls = [lambda: client.completions.create(model=MODEL, prompt="hello", max_tokens=4),
             lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=4),
             lambda: client.responses.create(model=MODEL, input="hi", max_output_tokens=4)]
    for call in calls:
        with pytest.raises(openai.BadRequestError) as err:
            call()
        assert err.value.body["param"] == "model" and "--task generate" in err.value.body["message"]
        assert err.value.body["code"] == "model_not_supported"


def test_pooling_metrics_apart_from_generation(server: ServerThread, client: openai.OpenAI) -> None:
    def value(name: str, **labels: str) -> float:
        return server.metrics.registry.get_sample_value(name, {"model_name": MODEL, **labels}) or 0.0

    before = (value("minivllm_pooling_requests_finished_total", task="embed", finish_reason="stop"),
              value("minivllm_pooling_prompt_tokens_total", task="embed"),
              value("minivllm_pooling_request_latency_seconds_count", task="embed"),
              value("minivllm_requests_finished_total", finish_reason="stop"))
    result = client.embeddings.create(model=MODEL, input=TEXTS)
    # the step's stats reach the listeners on the engine thread, beside the outputs' delivery
    assert poll(lambda: value("minivllm_pooling_request_latency_seconds_count", task="embed") - before[2] >= len(TEXTS), 10)
    after = (value("minivllm_pooling_requests_finished_total", task="embed", finish_reason="stop"),
             value("minivllm_pooling_prompt_tokens_total", task="embed"),
             value("minivllm_pooling_request_latency_seconds_count", task="embed"),
             value("minivllm_requests_finished_total", finish_reason="stop"))
    assert after[0] - before[0] == len(TEXTS)
    assert after[1] - before[1] == result.usage.prompt_tokens
    assert after[2] - before[2] == len(TEXTS)
    assert after[3] == before[3]  # generation's count is generation's
    # the call's own series (recorded as its response ends)
    assert poll(lambda: value("minivllm_api_requests_total", protocol="http", method="/v1/embeddings",
                              code="200") >= 1, 10)


def test_embeddings_refused_on_a_generation_model(tiny_model_dir: Path) -> None:
    srv = ServerThread(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, block_size=4), http_port=0,
                       served_model_name="tiny")
    try:
        status, answer = _post(srv, {"model": "tiny", "input": "hello"})
        assert status == 400 and answer["error"]["param"] == "model" and "--task embed" in answer["error"]["message"]
    finally:
        srv.stop()
