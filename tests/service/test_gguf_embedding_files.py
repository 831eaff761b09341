"""Serving a GGUF embedding file as llama.cpp's converter writes one (tests.field_gguf's "qwen3-embed":
a tiny random Qwen3 embedder saved by sentence-transformers, last-token pooling and Normalize,
converted by convert_hf_to_gguf.py, which writes qwen3.pooling_type = last): `--task auto` serves it
as an embedder pooling as the file says, normalised as llama.cpp's server normalises, and its
vectors equal sentence-transformers' encode() on the source directory: an f32 file's within float
rounding (cosine >= 0.9999) on both paths (its tensors as they are, and transformers' conversion),
a q8_0 file's, kept in its blocks, within the weights' and activations' int8 rounding (cosine >=
0.998; 0.9992 measured at the worst text, 0.9996 for the same file dequantized). Through
`minivllm serve --model FILE.gguf` and the openai SDK's embeddings.create.

The first load of a file reads its 151,936-token vocabulary from the metadata (about a minute);
later runs find the derived directory in the cache.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from engine import LLM, PoolingType
from engine.execution.weights.quantized_weight import QuantizedWeight
from engine.processing.pooling_params import PoolerConfig
from tests.field_gguf import field_gguf
from tests.helpers import cosines
from tests.server_harness import served_embeddings

TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog. " * 6, "a", "Unicode: café, naïve, 你好, 世界",
         "def main():\n    print('hello')\n    return 0\n" * 3]
MIN_COSINE = {"f32": 0.9999, "q8_0": 0.998}


@pytest.fixture(scope="module")
def expected() -> np.ndarray:
    """sentence-transformers' encode() on the directory the files were converted from: [texts, 64], unit rows."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(field_gguf("qwen3-embed", "f32")[1]), device="cpu").encode(TEXTS)


@pytest.mark.parametrize(("outtype", "quantization"), [("f32", "none"), ("q8_0", "gguf")])
def test_a_file_embeds_as_sentence_transformers_encodes(outtype: str, quantization: str,
                                                        expected: np.ndarray) -> None:
    """The file's pooling (not the engine's default alone: the derived directory holds its recipe)
    and task auto; prompts chunked 16 tokens a step; q8_0's projections and embedding as blocks."""
    llm = LLM(str(field_gguf("qwen3-embed", outtype)[0]), quantization=quantization, num_kv_blocks=64, block_size=4,
              max_num_batched_tokens=16)
    engine = llm.engine
    assert engine.task == "embed" and engine.config.quantization == quantization
    assert engine.pooler_config == PoolerConfig(PoolingType.LAST, normalize=True)
    modules = json.loads((engine.model_dir / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[-1] for m in modules] == ["Transformer", "Pooling", "Normalize"]
    assert max(len(ids) for ids in llm.tokenizer(TEXTS)["input_ids"]) > 16  # some prompts really are chunked
    if quantization == "gguf":
        model = engine.runner.model
        projections = [m for layer in model.layers for m in layer.projections]
        assert all(isinstance(m.panels, QuantizedWeight) for m in projections)
    got = np.array([o.embedding for o in llm.embed(TEXTS)])
    assert got.shape == expected.shape
    assert cosines(got, expected).min() >= MIN_COSINE[outtype], cosines(got, expected)
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-5)
    if outtype == "q8_0":  # the blocks' rounding shows: not the float model's vectors
        assert cosines(got, expected).min() < 0.99999


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_serve_embeds_a_file_through_the_openai_sdk(outtype: str, expected: np.ndarray) -> None:
    """`minivllm serve --model FILE.gguf`, task auto: an embedding server (its generation routes
    refused), its vectors sentence-transformers'."""
    vectors, prompt_tokens = served_embeddings(field_gguf("qwen3-embed", outtype)[0], TEXTS,
                                               "--max-num-batched-tokens", "16")
    got = np.array(vectors)
    assert cosines(got, expected).min() >= MIN_COSINE[outtype], cosines(got, expected)
    assert prompt_tokens > 0
