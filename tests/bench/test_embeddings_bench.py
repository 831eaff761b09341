"""bench.embeddings' passages: their lengths are what the model sees, special tokens counted."""
from __future__ import annotations

from pathlib import Path

from bench.embeddings import passages
from tests.tiny_bert import build_bert_tokenizer


def test_passages_fit_max_tokens_with_the_special_tokens_counted(tmp_path: Path) -> None:
    tokenizer = build_bert_tokenizer(tmp_path / "tok")  # its post-processor adds [CLS] ... [SEP]
    texts = passages(tokenizer, num=40, min_tokens=8, max_tokens=24, seed=3)
    lengths = [len(tokenizer(text)["input_ids"]) for text in texts]  # [CLS] ... [SEP] included
    assert max(lengths) <= 24, lengths
    # a passage is cut only as far as needed: most land near their drawn target, not at the floor
    assert sum(lengths) / len(lengths) > 12, lengths
