"""minivllm.v1 Score: the same scores as transformers' sigmoid(logits) (and as /rerank), bad
input named by field, and a generation model's server refusing the RPC."""
from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from engine import EngineConfig
from service.grpc.minivllm_client import InferenceClient
from service.pb import inference_pb2 as pb
from tests.server_harness import ServerThread
from tests.tiny_model import build_tiny_sequence_classifier

QUERY = "what is a paged KV cache?"
DOCUMENTS = ["A paged KV cache stores keys and values in fixed-size blocks.", "Hello world!",
             "The quick brown fox jumps over the lazy dog. " * 3]


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_sequence_classifier(tmp_path_factory.mktemp("reranker") / "qwen3-cls")


@pytest.fixture(scope="module")
def server(classifier_dir: Path) -> Iterator[ServerThread]:
    srv = ServerThread(EngineConfig(model=str(classifier_dir), num_kv_blocks=128, block_size=4,
                                    max_num_batched_tokens=16), http_port=0)
    yield srv
    srv.stop()


def test_score_equals_transformers_and_rerank(server: ServerThread, classifier_dir: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(classifier_dir))
    model = AutoModelForSequenceClassification.from_pretrained(str(classifier_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [torch.sigmoid(model(**tokenizer(QUERY, d, return_tensors="pt")).logits[0, 0]).item()
                    for d in DOCUMENTS]
    with InferenceClient(server.target, timeout=60) as client:
        assert client.model_info().task == "score"
        got = client.score(QUERY, DOCUMENTS)
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
        response = client.stub.Score(pb.ScoreRequest(request_id="mine", query=QUERY, documents=DOCUMENTS[:1]))
        assert response.request_id == "mine"
        assert response.usage.prompt_tokens == len(tokenizer(QUERY, DOCUMENTS[0])["input_ids"])
    body = json.dumps({"query": QUERY, "documents": DOCUMENTS}).encode()
    request = urllib.request.Request(server.http_url + "/rerank", data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        results = json.load(resp)["results"]
    by_index = {r["index"]: r["relevance_score"] for r in results}
    # the same pairs' scores (up to float sums in another order: a cached prefix, other step packings)
    np.testing.assert_allclose([by_index[i] for i in range(len(DOCUMENTS))], got, atol=1e-6, rtol=0)


@pytest.mark.parametrize(("request_fields", "field", "code"), [
    ({"query": "", "documents": ["a"]}, "query", grpc.StatusCode.INVALID_ARGUMENT),
    ({"query": "q"}, "documents", grpc.StatusCode.INVALID_ARGUMENT),
    ({"query": "q", "documents": ["a", ""]}, "documents[1]", grpc.StatusCode.INVALID_ARGUMENT),
    ({"query": "q", "documents": ["a", "hello world " * 400]}, "documents[1]", grpc.StatusCode.RESOURCE_EXHAUSTED),
    ({"query": "q", "documents": ["a"] * 1001}, "documents", grpc.StatusCode.RESOURCE_EXHAUSTED),
])
def test_bad_input_named_by_field(server: ServerThread, request_fields: dict, field: str,
                                  code: grpc.StatusCode) -> None:
    with InferenceClient(server.target, timeout=60) as client, pytest.raises(grpc.RpcError) as err:
        client.stub.Score(pb.ScoreRequest(**request_fields))
    assert err.value.code() is code, err.value.details()
    assert err.value.details().startswith(field + " ") or err.value.details().startswith(field + ":"), \
        err.value.details()


def test_generation_model_refuses_score(tiny_model_dir: Path) -> None:
    srv = ServerThread(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, block_size=4))
    try:
        with InferenceClient(srv.target, timeout=60) as client, pytest.raises(grpc.RpcError) as err:
            client.score("q", ["a"])
        assert err.value.code() is grpc.StatusCode.UNIMPLEMENTED and "--task score" in err.value.details()
    finally:
        srv.stop()


def test_score_model_refuses_generate_and_embed(server: ServerThread) -> None:
    with InferenceClient(server.target, timeout=60) as client:
        for call in (lambda: client.complete("hello", max_tokens=4), lambda: client.embed(["hello"])):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() is grpc.StatusCode.UNIMPLEMENTED and "'score'" in err.value.details()
