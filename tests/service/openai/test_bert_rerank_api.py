"""BERT-family cross-encoders behind /score and /rerank: a tiny random BertForSequenceClassification
(its pair's token types reaching the model) and an XLMRobertaForSequenceClassification (one
segment), served with task auto (score, from config.architectures), equal sentence-transformers'
CrossEncoder.predict() within 1e-5, the documents run whole and together in one step each."""
from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from engine import EngineConfig
from tests.server_harness import ServerThread
from tests.tiny_bert import build_tiny_bert_cross_encoder

QUERY = "what is the capital of france?"
DOCUMENTS = ["Paris is the capital and largest city of France.", "The quick brown fox jumps over the lazy dog.",
             "hello", "Numbers: 0 1 2 3 4 5"]


def _post(server: ServerThread, route: str, body: dict) -> dict:
    request = urllib.request.Request(server.http_url + route, data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.load(resp)


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_scores_equal_cross_encoder_predict(tmp_path: Path, family: str) -> None:
    from sentence_transformers import CrossEncoder

    model_dir = build_tiny_bert_cross_encoder(tmp_path / family, family=family)
    expected = CrossEncoder(str(model_dir), device="cpu").predict([(QUERY, d) for d in DOCUMENTS])
    assert np.ptp(expected) > 0.01  # the documents' scores differ
    server = ServerThread(EngineConfig(model=str(model_dir), block_size=4, max_num_batched_tokens=128),
                          http_port=0, served_model_name="ce")
    try:
        assert server.engine.task == "score" and server.engine.uses_token_types == (family == "bert")
        scored = _post(server, "/score", {"text_1": QUERY, "text_2": DOCUMENTS})
        np.testing.assert_allclose([d["score"] for d in scored["data"]], expected, atol=1e-5, rtol=0)
        ranked = _post(server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS})
        assert [r["index"] for r in ranked["results"]] == list(np.argsort(-expected))
        np.testing.assert_allclose([r["relevance_score"] for r in ranked["results"]], np.sort(expected)[::-1],
                                   atol=1e-5, rtol=0)
    finally:
        server.stop()
