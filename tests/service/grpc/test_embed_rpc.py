"""minivllm.v1 Embed: the same vectors as sentence-transformers' encode() (and as /v1/embeddings),
bad input named by field, and a generation model's server refusing the RPC."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from engine import EngineConfig
from service.grpc.minivllm_client import InferenceClient
from service.pb import inference_pb2 as pb
from tests.helpers import cosines
from tests.server_harness import ServerThread
from tests.tiny_model import build_tiny_embedding_model

TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog. " * 6, "Unicode: café, 你好"]


@pytest.fixture(scope="module")
def embedding_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_embedding_model(tmp_path_factory.mktemp("embedder") / "mean", pooling_mode="mean")


@pytest.fixture(scope="module")
def server(embedding_dir: Path) -> Iterator[ServerThread]:
    srv = ServerThread(EngineConfig(model=str(embedding_dir), num_kv_blocks=128, block_size=4,
                                    max_num_batched_tokens=16))
    yield srv
    srv.stop()


def test_embed_equals_sentence_transformers(server: ServerThread, embedding_dir: Path) -> None:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(embedding_dir), device="cpu")
    expected = reference.encode(TEXTS)
    ids = [reference.tokenizer(t)["input_ids"] for t in TEXTS]
    with InferenceClient(server.target, timeout=60) as client:
        info = client.model_info()
        assert info.task == "embed" and info.hidden_size == 64
        assert cosines(np.array(client.embed(TEXTS)), expected).min() >= 0.9999
        assert cosines(np.array(client.embed([TEXTS[0], ids[1], TEXTS[2]])), expected).min() >= 0.9999
        cut = np.array(client.embed(TEXTS, dimensions=16))
        assert cut.shape == (len(TEXTS), 16)
        assert cosines(cut, reference.encode(TEXTS, truncate_dim=16)).min() >= 0.9999
        raw = np.array(client.embed(TEXTS, normalize=False))
        assert np.linalg.norm(raw, axis=-1).min() > 1.5
        response = client.stub.Embed(pb.EmbedRequest(request_id="mine", inputs=[pb.EmbedInput(prompt=TEXTS[0])]))
        assert response.request_id == "mine" and response.usage.prompt_tokens == len(ids[0])


@pytest.mark.parametrize(("request_fields", "field"), [
    ({"inputs": []}, "inputs"),
    ({"inputs": [pb.EmbedInput(prompt="ok"), pb.EmbedInput()]}, "inputs[1]"),
    ({"inputs": [pb.EmbedInput(prompt="ok"), pb.EmbedInput(prompt="")]}, "inputs[1].prompt"),
    ({"inputs": [pb.EmbedInput(prompt_token_ids=pb.TokenIds(ids=[1, 100000]))]}, "inputs[0].prompt_token_ids"),
    ({"inputs": [pb.EmbedInput(prompt="ok")], "dimensions": 65}, "dimensions"),
    ({"inputs": [pb.EmbedInput(prompt="ok")], "pooling_type": "max"}, "pooling_type"),
])
def test_bad_input_named_by_field(server: ServerThread, request_fields: dict, field: str) -> None:
    with InferenceClient(server.target, timeout=60) as client, pytest.raises(grpc.RpcError) as err:
        client.stub.Embed(pb.EmbedRequest(**request_fields))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field + " ") or err.value.details().startswith(field + ":"), \
        err.value.details()


def test_generation_model_refuses_embed(tiny_model_dir: Path) -> None:
    srv = ServerThread(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, block_size=4))
    try:
        with InferenceClient(srv.target, timeout=60) as client, pytest.raises(grpc.RpcError) as err:
            client.embed(["hello"])
        assert err.value.code() is grpc.StatusCode.UNIMPLEMENTED and "--task embed" in err.value.details()
    finally:
        srv.stop()


def test_embedding_model_refuses_generate(server: ServerThread) -> None:
    """The other direction, on both contracts' Generate: the RPC is not enabled for this model."""
    from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
    from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

    with InferenceClient(server.target, timeout=60) as client, pytest.raises(grpc.RpcError) as err:
        client.complete("hello", max_tokens=4)
    assert err.value.code() is grpc.StatusCode.UNIMPLEMENTED and "--task generate" in err.value.details()
    with grpc.insecure_channel(server.target) as channel, pytest.raises(grpc.RpcError) as err:
        stub = vpb_grpc.VllmEngineStub(channel)
        request = vpb.GenerateRequest(request_id="r", stream=True, tokenized=vpb.TokenizedInput(input_ids=[5, 6, 7]),
                                      sampling_params=vpb.SamplingParams(max_tokens=4))
        list(stub.Generate(request, timeout=60))
    assert err.value.code() is grpc.StatusCode.UNIMPLEMENTED and "--task generate" in err.value.details()
