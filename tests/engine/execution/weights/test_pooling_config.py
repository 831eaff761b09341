"""An embedder's pooling recipe: a GGUF file's pooling_type read as llama.cpp defines it, and the
recipe written into a derived model directory read back as sentence-transformers' own."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.execution.weights import checkpoint
from engine.execution.weights.gguf_config import gguf_pooler_config
from engine.execution.weights.gguf_file import GGUFFile
from engine.execution.weights.pooling_config import load_pooler_config, write_pooler_config
from engine.processing.pooling_params import PoolerConfig, PoolingType
from tests.gguf_samples import T, write_gguf


def _file(path: Path, pooling_type: int | None) -> GGUFFile:
    metadata = {"embedding_length": 64, "attention.head_count": 4}
    if pooling_type is not None:
        metadata["pooling_type"] = pooling_type
    return GGUFFile(write_gguf(path, "qwen3", metadata, {"output_norm.weight": (np.ones(64, np.float32), T.F32)}))


@pytest.mark.parametrize(("value", "expected"), [(None, None), (0, None), (1, PoolingType.MEAN), (2, PoolingType.CLS),
                                                 (3, PoolingType.LAST)])
def test_a_files_pooling_type_as_llama_cpp_defines_it(tmp_path: Path, value: int | None,
                                                      expected: PoolingType | None) -> None:
    """No key or none: a model that pools nothing; mean, cls, last: normalised, as llama.cpp's server
    normalises every pooled embedding by default."""
    config = gguf_pooler_config(_file(tmp_path / "m.gguf", value))
    assert config == (None if expected is None else PoolerConfig(expected, normalize=True))


def test_a_reranker_file_and_an_unknown_type_are_refused_naming_them(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="reranker .pooling_type rank.*--task score"):
        gguf_pooler_config(_file(tmp_path / "rank.gguf", 4))
    with pytest.raises(ValueError, match="pooling_type 7"):
        gguf_pooler_config(_file(tmp_path / "odd.gguf", 7))


def test_a_bert_cross_encoders_file_is_refused_as_a_reranker(tmp_path: Path) -> None:
    """The converter writes a BertForSequenceClassification's classifier as cls.output and no
    pooling_type (it drops the BERT pooler layer the classifier reads)."""
    head = {"cls.output.weight": (np.ones((1, 64), np.float32), T.F32), "cls.output.bias": (np.ones(1, np.float32), T.F32)}
    file = GGUFFile(write_gguf(tmp_path / "rerank.gguf", "bert", {"embedding_length": 64, "attention.head_count": 4},
                               head))
    with pytest.raises(ValueError, match="reranker .a classifier head, cls.output.*--task score"):
        gguf_pooler_config(file)


@pytest.mark.parametrize("pooling_type", list(PoolingType))
@pytest.mark.parametrize("normalize", [True, False])
def test_a_written_recipe_reads_back(tmp_path: Path, pooling_type: PoolingType, normalize: bool) -> None:
    write_pooler_config(tmp_path, PoolerConfig(pooling_type, normalize), hidden_size=64)
    assert load_pooler_config(tmp_path) == PoolerConfig(pooling_type, normalize)
    modules = json.loads((tmp_path / "modules.json").read_text())
    assert [m["path"] for m in modules] == ["", "1_Pooling"] + (["2_Normalize"] if normalize else [])
    assert json.loads((tmp_path / "1_Pooling" / "config.json").read_text())["word_embedding_dimension"] == 64


def test_an_entry_of_an_older_format_is_stale_a_newer_ones_is_kept(tmp_path: Path) -> None:
    """Entries made before the pooling recipe was written lack it: another key, and pruned. A newer
    format's entry (a newer version sharing the cache) is kept while its file is unchanged."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    entry = tmp_path / "entry"
    entry.mkdir()
    source = checkpoint._gguf_source(gguf)

    def is_stale(record: dict) -> bool:
        (entry / "source.json").write_text(json.dumps(record))
        return checkpoint._is_stale(entry)

    assert not is_stale(source)
    assert is_stale({k: v for k, v in source.items() if k != "format"})
    assert is_stale(source | {"format": source["format"] - 1})
    assert not is_stale(source | {"format": source["format"] + 1})
    assert is_stale(source | {"format": source["format"] + 1, "size": 5})
