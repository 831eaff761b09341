"""A BERT embedder's doors: POST /v1/embeddings through the official `openai` SDK and gRPC's
Embed on the same server. A batch of texts of different lengths (run whole, together) and token
ids equal sentence-transformers' encode() on a tiny random BertModel with CLS pooling and
Normalize; a text over the step's token budget is refused naming the input."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import openai
import pytest

from engine import EngineConfig
from service.grpc.minivllm_client import InferenceClient
from tests.helpers import cosines
from tests.server_harness import ServerThread
from tests.tiny_bert import build_tiny_bert_embedder

MODEL = "tiny-bert"
TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog. " * 2, "a", "What is the capital of France?"]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bert_embedder(tmp_path_factory.mktemp("bert") / "cls")


@pytest.fixture(scope="module")
def server(bert_dir: Path) -> Iterator[ServerThread]:
    srv = ServerThread(EngineConfig(model=str(bert_dir), block_size=4, max_num_batched_tokens=64), http_port=0,
                       served_model_name=MODEL)
    yield srv
    srv.stop()


@pytest.fixture()
def client(server: ServerThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_texts_and_token_ids_equal_sentence_transformers(client: openai.OpenAI, bert_dir: Path) -> None:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(bert_dir), device="cpu")
    expected = reference.encode(TEXTS)
    result = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    got = np.array([d.embedding for d in result.data])
    assert [d.index for d in result.data] == list(range(len(TEXTS)))
    assert cosines(got, expected).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-5)
    ids = [reference.tokenizer(t)["input_ids"] for t in TEXTS]  # [CLS] ... [SEP], as the engine's own
    assert result.usage.prompt_tokens == sum(map(len, ids))
    as_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    assert cosines(np.array([d.embedding for d in as_ids.data]), expected).min() >= 0.9999


def test_a_text_longer_than_a_step_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model=MODEL, input=["ok", "The quick brown fox jumps over the lazy dog. " * 8])
    assert err.value.body["param"] == "input[1]" and "max_num_batched_tokens" in err.value.body["message"]


def test_grpc_embed_equals_sentence_transformers(server: ServerThread, bert_dir: Path) -> None:
    from sentence_transformers import SentenceTransformer

    expected = SentenceTransformer(str(bert_dir), device="cpu").encode(TEXTS)
    with InferenceClient(server.target, timeout=60) as client:
        assert client.model_info().task == "embed"
        assert cosines(np.array(client.embed(TEXTS)), expected).min() >= 0.9999
        with pytest.raises(grpc.RpcError) as err:
            client.embed(["ok", "The quick brown fox jumps over the lazy dog. " * 8])
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # a prompt longer than the model
    assert "inputs[1]" in err.value.details() and "max_num_batched_tokens" in err.value.details()
