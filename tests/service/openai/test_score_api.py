"""POST /rerank and /score on tiny random rerankers: a Qwen3ForSequenceClassification's scores
equal transformers' sigmoid(logits) of its tokenizer's pair encoding (and sentence-transformers'
CrossEncoder.predict), a Qwen3 causal LM served with --task score equals Qwen3-Reranker's
model-card computation on its prompt template; ordering, top_n, return_documents, bad fields,
the refusals between tasks, and score requests counted under their own task."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import EngineConfig
from service.observability.metrics import ServiceMetrics
from service.score_prompts import QWEN3_RERANKER_PREFIX, QWEN3_RERANKER_SUFFIX
from tests.server_harness import ServerThread, poll

MODEL = "tiny-reranker"
QUERY = "what is a paged KV cache?"
DOCUMENTS = ["A paged KV cache stores keys and values in fixed-size blocks.", "Hello world!",
             "The quick brown fox jumps over the lazy dog. " * 3, "Unicode: café, naïve, 你好, 世界",
             "Prefill processes the whole prompt; decode produces one token at a time."]


@pytest.fixture(scope="module")
def server(classifier_dir: Path) -> Iterator[ServerThread]:
    metrics = ServiceMetrics(MODEL)
    srv = ServerThread(EngineConfig(model=str(classifier_dir), num_kv_blocks=128, block_size=4,
                                    max_num_batched_tokens=16),
                       stats_listeners=[metrics.on_step], http_port=0, served_model_name=MODEL)
    srv.metrics = metrics
    yield srv
    srv.stop()


def _post(server: ServerThread, route: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(server.http_url + route, data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def _classifier_scores(model_dir: Path, pairs: list[tuple[str, str]]) -> np.ndarray:
    """transformers' sigmoid of each pair's logit, one pair at a time (no padding)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return np.array([torch.sigmoid(model(**tokenizer(q, d, return_tensors="pt")).logits[0, 0]).item()
                         for q, d in pairs])


def test_score_equals_transformers_and_cross_encoder(server: ServerThread, classifier_dir: Path) -> None:
    """/score 1:N and 1:1 (both routes), in pair order, with usage; and CrossEncoder.predict agrees."""
    expected = _classifier_scores(classifier_dir, [(QUERY, d) for d in DOCUMENTS])
    assert np.ptp(expected) > 0.01
    status, answer = _post(server, "/score", {"model": MODEL, "text_1": QUERY, "text_2": DOCUMENTS})
    assert status == 200, answer
    assert [d["index"] for d in answer["data"]] == list(range(len(DOCUMENTS)))
    assert all(d["object"] == "score" for d in answer["data"]) and answer["model"] == MODEL
    np.testing.assert_allclose([d["score"] for d in answer["data"]], expected, atol=1e-5, rtol=0)
    assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] > len(DOCUMENTS)
    firsts = ["hello", "what is a paged KV cache?"]
    status, one_to_one = _post(server, "/v1/score", {"text_1": firsts, "text_2": DOCUMENTS[:2]})
    assert status == 200, one_to_one
    np.testing.assert_allclose([d["score"] for d in one_to_one["data"]],
                               _classifier_scores(classifier_dir, list(zip(firsts, DOCUMENTS[:2], strict=True))),
                               atol=1e-5, rtol=0)
    status, single = _post(server, "/score", {"text_1": QUERY, "text_2": DOCUMENTS[2]})
    assert status == 200 and abs(single["data"][0]["score"] - expected[2]) < 1e-5
    from sentence_transformers import CrossEncoder

    predicted = CrossEncoder(str(classifier_dir), device="cpu").predict([(QUERY, d) for d in DOCUMENTS])
    np.testing.assert_allclose(predicted, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("route", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_documents(server: ServerThread, classifier_dir: Path, route: str) -> None:
    """Results best first with the request's indices; top_n keeps the best N; documents as
    strings or {"text": ...}, echoed unless return_documents is false."""
    expected = _classifier_scores(classifier_dir, [(QUERY, d) for d in DOCUMENTS])
    order = [int(i) for i in np.argsort(-expected, kind="stable")]
    documents = [d if i % 2 else {"text": d} for i, d in enumerate(DOCUMENTS)]
    status, answer = _post(server, route, {"model": MODEL, "query": QUERY, "documents": documents})
    assert status == 200, answer
    assert [r["index"] for r in answer["results"]] == order
    np.testing.assert_allclose([r["relevance_score"] for r in answer["results"]], expected[order], atol=1e-5, rtol=0)
    assert [r["document"]["text"] for r in answer["results"]] == [DOCUMENTS[i] for i in order]
    assert answer["usage"]["total_tokens"] > 0 and answer["model"] == MODEL
    status, top = _post(server, route, {"query": QUERY, "documents": DOCUMENTS, "top_n": 2,
                                        "return_documents": False})
    assert status == 200
    assert [r["index"] for r in top["results"]] == order[:2] and all("document" not in r for r in top["results"])


def test_label_token_reranker_equals_its_model_card(reranker_lm_dir: Path) -> None:
    """A causal LM served with --task score: each document in Qwen3-Reranker's prompt (the card's
    prefix, <Instruct>/<Query>/<Document> turn and suffix, tokenized as the card does), its score
    the card's softmax over [no, yes] of the last token; a custom instruction changes the prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(reranker_lm_dir))
    model = AutoModelForCausalLM.from_pretrained(str(reranker_lm_dir), dtype=torch.float32).eval()
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    prefix = tokenizer.encode(QWEN3_RERANKER_PREFIX, add_special_tokens=False)
    suffix = tokenizer.encode(QWEN3_RERANKER_SUFFIX, add_special_tokens=False)

    def card(instruction: str) -> np.ndarray:
        turns = [f"<Instruct>: {instruction}\n<Query>: {QUERY}\n<Document>: {d}" for d in DOCUMENTS]
        inputs = tokenizer(turns, padding=False, truncation="longest_first", return_attention_mask=False)
        scores = []
        with torch.no_grad():
            for ids in inputs["input_ids"]:
                logits = model(torch.tensor([prefix + ids + suffix])).logits[0, -1]
                scores.append(torch.log_softmax(torch.stack([logits[no], logits[yes]]), dim=0).exp()[1].item())
        return np.array(scores)

    srv = ServerThread(EngineConfig(model=str(reranker_lm_dir), task="score", num_kv_blocks=256, block_size=4,
                                    max_num_batched_tokens=64), http_port=0, served_model_name=MODEL)
    try:
        expected = card("Given a web search query, retrieve relevant passages that answer the query")
        assert np.ptp(expected) > 0.01
        status, answer = _post(srv, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS})
        assert status == 200, answer
        got = {r["index"]: r["relevance_score"] for r in answer["results"]}
        np.testing.assert_allclose([got[i] for i in range(len(DOCUMENTS))], expected, atol=1e-5, rtol=0)
        assert [r["index"] for r in answer["results"]] == [int(i) for i in np.argsort(-expected, kind="stable")]
        asked = card("Find the passage that defines the term")
        status, answer = _post(srv, "/score", {"text_1": QUERY, "text_2": DOCUMENTS,
                                               "instruction": "Find the passage that defines the term"})
        assert status == 200, answer
        np.testing.assert_allclose([d["score"] for d in answer["data"]], asked, atol=1e-5, rtol=0)
        assert np.abs(asked - expected).max() > 1e-4  # the instruction is in the prompt
    finally:
        srv.stop()


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/v1/rerank", {"query": "", "documents": ["a"]}, "query"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["a", ""]}, "documents[1]"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
    ("/v1/rerank", {"query": "q", "documents": ["a", "\ud800"]}, "documents[1]"),
    ("/v1/rerank", {"query": "q", "documents": ["a", "hello world " * 400]}, "documents[1]"),
    ("/v1/rerank", {"query": "q", "documents": [{"txt": "a"}]}, "documents[0]"),
    ("/v1/rerank", {"documents": ["a"]}, "query"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
    ("/score", {"text_1": "a", "text_2": []}, "text_2"),
    ("/score", {"text_1": "", "text_2": "b"}, "text_1"),
    ("/score", {"text_1": "a", "text_2": ["b", "hello world " * 400]}, "text_2[1]"),
])
def test_bad_fields_are_named(server: ServerThread, route: str, body: dict, param: str) -> None:
    status, answer = _post(server, route, body)
    assert status == 400, answer
    assert answer["error"]["param"] == param or answer["error"]["param"].startswith(param), answer


def test_unknown_model_is_404(server: ServerThread) -> None:
    status, answer = _post(server, "/v1/rerank", {"model": "other", "query": "q", "documents": ["a"]})
    assert status == 404 and answer["error"]["param"] == "model"


def test_a_score_server_refuses_generation_and_embeddings(server: ServerThread) -> None:
    for route, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                        ("/v1/completions", {"prompt": "hi"}), ("/v1/embeddings", {"input": "hi"})):
        status, answer = _post(server, route, {"model": MODEL, **body})
        assert status == 400 and answer["error"]["param"] == "model", (route, answer)
        assert "'score'" in answer["error"]["message"], answer


def test_a_generation_server_refuses_rerank_and_score(tiny_model_dir: Path) -> None:
    srv = ServerThread(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, block_size=4), http_port=0,
                       served_model_name="tiny")
    try:
        for route, body in (("/rerank", {"query": "q", "documents": ["a"]}), ("/score", {"text_1": "a", "text_2": "b"})):
            status, answer = _post(srv, route, body)
            assert status == 400 and answer["error"]["param"] == "model", answer
            assert "--task score" in answer["error"]["message"]
    finally:
        srv.stop()


def test_score_requests_counted_under_their_task(server: ServerThread) -> None:
    def value(name: str, **labels: str) -> float:
        return server.metrics.registry.get_sample_value(name, {"model_name": MODEL, **labels}) or 0.0

    before = (value("minivllm_pooling_requests_finished_total", task="score", finish_reason="stop"),
              value("minivllm_pooling_prompt_tokens_total", task="score"),
              value("minivllm_pooling_request_latency_seconds_count", task="embed"),
              value("minivllm_requests_finished_total", finish_reason="stop"))
    status, answer = _post(server, "/rerank", {"query": QUERY, "documents": DOCUMENTS})
    assert status == 200
    assert poll(lambda: value("minivllm_pooling_requests_finished_total", task="score", finish_reason="stop")
                - before[0] >= len(DOCUMENTS), 10)
    assert value("minivllm_pooling_prompt_tokens_total", task="score") - before[1] == answer["usage"]["prompt_tokens"]
    assert value("minivllm_pooling_request_latency_seconds_count", task="embed") == before[2]
    assert value("minivllm_requests_finished_total", finish_reason="stop") == before[3]


def test_token_types_travel_with_each_pair(classifier_dir: Path) -> None:
    """For a model that reads token types, each pair's types come from its tokenizer's pair
    encoding and reach the forward with their tokens (the Qwen3 classifier is made to claim it
    reads them; the recording forward passes them by)."""
    from transformers import AutoTokenizer

    from engine import LLMEngine

    config = EngineConfig(model=str(classifier_dir), num_kv_blocks=128, block_size=4, max_num_batched_tokens=16)
    seen: list[tuple[int, int]] = []

    def factory() -> LLMEngine:
        engine = LLMEngine(config)
        engine.uses_token_types = engine.runner.uses_token_types = True
        forward = engine.runner.backend.forward

        def recording_forward(model, input_ids, positions, attn, kv_caches, token_type_ids=None, **inputs):
            types = [0] * len(input_ids) if token_type_ids is None else token_type_ids.tolist()
            seen.extend(zip(input_ids.tolist(), types, strict=True))
            return forward(model, input_ids, positions, attn, kv_caches, **inputs)  # the rows read after it

        engine.runner.backend.forward = recording_forward
        return engine

    srv = ServerThread(config, engine_factory=factory, http_port=0, served_model_name=MODEL)
    try:
        status, answer = _post(srv, "/score", {"text_1": QUERY, "text_2": DOCUMENTS[:3]})
        assert status == 200, answer
    finally:
        srv.stop()
    tokenizer = AutoTokenizer.from_pretrained(str(classifier_dir))
    expected = []
    for document in DOCUMENTS[:3]:
        encoded = tokenizer(QUERY, document, return_token_type_ids=True)
        expected += zip(encoded["input_ids"], encoded["token_type_ids"], strict=True)
    assert any(t for _, t in expected)  # the documents' tokens are segment 1
    assert sorted(seen) == sorted(expected)  # every token once, with its type (no prefix reuse across types)
