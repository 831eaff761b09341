"""Serving a `bert` GGUF embedding file as llama.cpp's converter writes one (tests.field_gguf's
"bert-embed" and "bert-embed-cls": a tiny random BertModel with bge-small's WordPiece vocabulary,
saved by sentence-transformers with mean or CLS pooling and Normalize, converted by
convert_hf_to_gguf.py, which writes bert.pooling_type and the vocabulary in llama.cpp's
phantom-space form).

`--task auto` serves it as an embedder pooling as the file says, and its vectors equal
sentence-transformers' encode() on the source directory: an f32 file's within float rounding on
both paths (quantization none's conversion to safetensors, gguf's tensors as they are), an f16
file's within its weights' rounding (cosine >= 0.9999; 0.9999998 measured), a q8_0 file's, its
projections and word embedding kept in their blocks, within the weights' and activations' int8
rounding (cosine >= 0.999; 0.99981 measured at the worst text). The tokenizer rebuilt from the
file's metadata gives the source tokenizer's ids (accents, punctuation, CJK, an unknown
character, uppercase) and the real bge tokenizer's on llama.cpp's own vocabulary test texts.
Through `minivllm serve --model FILE.gguf` and the openai SDK's embeddings.create. A BERT
cross-encoder's file ("bert-rerank") is refused as a reranker.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from engine import LLM, PoolingType
from engine.execution.weights.quantized_weight import QuantizedWeight
from engine.processing.pooling_params import PoolerConfig
from tests.field_gguf import BGE_VOCAB, field_gguf
from tests.helpers import cosines
from tests.llama_cpp_sdist import llama_cpp_sdist
from tests.server_harness import served_embeddings

TEXTS = ["hello world", "The QUICK Brown Fox jumps over the lazy dog. " * 4, "a",
         "Unicode: café, naïve, Äpfel, 你好, 世界!", "an unknown 🦙 and a rare word: zyzzogeton's (x+y)=z?",
         "def main():\n    print('hello')\n    return 0\n"]
MIN_COSINE = {"f32": 0.9999, "f16": 0.9999, "q8_0": 0.999}
_UNK_ID = 100  # bge's [UNK]
_POOLING = {"bert-embed": PoolingType.MEAN, "bert-embed-cls": PoolingType.CLS}


def _expected(family: str) -> np.ndarray:
    """sentence-transformers' encode() on the directory the files were converted from: [texts, 64], unit rows."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(field_gguf(family, "f32")[1]), device="cpu").encode(TEXTS)


@pytest.mark.parametrize(("family", "outtype", "quantization"),
                         [("bert-embed", "f32", "none"), ("bert-embed", "f16", "gguf"), ("bert-embed", "q8_0", "gguf"),
                          ("bert-embed-cls", "f32", "gguf")])
def test_a_file_embeds_as_sentence_transformers_encodes(family: str, outtype: str, quantization: str) -> None:
    """The file's pooling (the derived directory holds its recipe: mean, not BERT's default CLS),
    task auto; q8_0's projections and word embedding as blocks."""
    llm = LLM(str(field_gguf(family, outtype)[0]), quantization=quantization, num_kv_blocks=64, block_size=4)
    engine = llm.engine
    assert engine.task == "embed" and engine.config.quantization == quantization
    assert engine.pooler_config == PoolerConfig(_POOLING[family], normalize=True)
    modules = json.loads((engine.model_dir / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[-1] for m in modules] == ["Transformer", "Pooling", "Normalize"]
    if outtype == "q8_0":
        model = engine.runner.model
        projections = [m for layer in model.layers for m in (layer.qkv_proj, layer.o_proj, layer.up_proj,
                                                              layer.down_proj)]
        assert all(isinstance(m.panels, QuantizedWeight) for m in projections)
        assert type(model.embed_tokens).__name__ == "QuantEmbedding"
    expected = _expected(family)
    got = np.array([o.embedding for o in llm.embed(TEXTS)])
    assert got.shape == expected.shape
    assert cosines(got, expected).min() >= MIN_COSINE[outtype], cosines(got, expected)
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-5)
    if outtype == "q8_0":  # the blocks' rounding shows: not the float model's vectors
        assert cosines(got, expected).min() < 0.99999


def test_a_cross_encoders_file_is_refused_naming_it() -> None:
    """A BertForSequenceClassification as the converter writes it (cls.output, no pooling_type, no
    pooler layer): refused as a reranker before anything is served, not failed on its tensors."""
    with pytest.raises(ValueError, match="is a reranker .a classifier head, cls.output.*--task score"):
        LLM(str(field_gguf("bert-rerank", "f32")[0]), num_kv_blocks=64, block_size=4)


def _vocab_test_cases() -> list[tuple[str, list[int]]]:
    """llama.cpp's tokenizer test texts for bge-small and the ids the real bge tokenizer gave them
    (without [CLS] / [SEP]): models/ggml-vocab-bert-bge.gguf.inp / .out."""
    models = llama_cpp_sdist() / BGE_VOCAB.parent
    # each text ends in the separator, each id list in a newline (an empty text's: an empty line)
    texts = (models / f"{BGE_VOCAB.name}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")[:-1]
    ids = (models / f"{BGE_VOCAB.name}.out").read_text(encoding="utf-8").split("\n")[:-1]
    assert len(texts) == len(ids) == 46, (len(texts), len(ids))
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, ids, strict=True)]


def test_the_rebuilt_tokenizer_encodes_as_the_source_and_as_bge() -> None:
    """The WordPiece vocabulary, special tokens and normaliser from the file's metadata (the
    converter's phantom-space tokens undone): the source directory's ids, with [CLS] / [SEP] and
    the unknown token where a character is not in the vocabulary, and bge's on llama.cpp's tests."""
    from transformers import AutoTokenizer

    path, hf_dir = field_gguf("bert-embed", "f32")
    llm = LLM(str(path), quantization="gguf", num_kv_blocks=64, block_size=4)
    served, source = llm.tokenizer, AutoTokenizer.from_pretrained(str(hf_dir))
    assert len(served) == len(source) == 30522
    got, want = served(TEXTS)["input_ids"], source(TEXTS)["input_ids"]
    assert got == want
    assert all(ids[0] == source.cls_token_id and ids[-1] == source.sep_token_id for ids in got)
    assert _UNK_ID in got[4] and source.unk_token_id == _UNK_ID
    for role in ("cls_token", "sep_token", "pad_token", "unk_token", "mask_token"):
        assert getattr(served, role) == getattr(source, role), role
    # the word-initial and continuation forms of one piece are told apart ("##s" is not "s")
    assert served.convert_ids_to_tokens(got[4]) == source.convert_ids_to_tokens(want[4])
    cases = _vocab_test_cases()
    mismatched = [(text, served.encode(text, add_special_tokens=False), ids) for text, ids in cases
                  if served.encode(text, add_special_tokens=False) != ids]
    assert not mismatched, mismatched[:3]


def test_serve_embeds_a_file_through_the_openai_sdk() -> None:
    """`minivllm serve --model FILE.gguf` (quantization auto: the blocks), task auto: an embedding
    server (its generation routes refused), its vectors sentence-transformers'."""
    vectors, prompt_tokens = served_embeddings(field_gguf("bert-embed", "q8_0")[0], TEXTS)
    got, expected = np.array(vectors), _expected("bert-embed")
    assert cosines(got, expected).min() >= MIN_COSINE["q8_0"], cosines(got, expected)
    assert prompt_tokens > 0
