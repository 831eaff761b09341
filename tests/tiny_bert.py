"""Tiny random BERT encoders with a real WordPiece tokenizer, built offline in seconds.

`build_tiny_bert_embedder`: a BertModel (or XLM-RoBERTa's) saved by sentence-transformers (modules.json,
1_Pooling/config.json, optionally Normalize), as bge / e5 / all-MiniLM ship. `build_tiny_bert_cross_encoder`:
a BertForSequenceClassification (a reranker's layout: bert.*, its pooler, classifier.*) with
the same tokenizer. The WordPiece vocabulary is trained here with the `tokenizers` package on a
small corpus, its post-processor adding [CLS] ... [SEP] (and [CLS] a [SEP] b [SEP] with token
types for a pair) as BERT's tokenizers do.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.tiny_model import save_sentence_transformer

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Prefill processes the whole prompt; decode produces one token at a time.",
    "Hello world! Once upon a time there was a small language model that served many users at once.",
    "What is the capital of France? Paris is the capital and largest city of France.",
    "Embeddings map sentences to vectors; a reranker scores a query against a document.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Unicode: café, naïve, accents éèê.",
]
_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# XLM-R's order of its specials (<s>, <pad>, </s>, <unk>): padding id 1, so positions start at 2.
_ROBERTA_SPECIAL = ["[CLS]", "[PAD]", "[SEP]", "[UNK]", "[MASK]"]


def build_bert_tokenizer(path: Path, vocab_size: int = 300, family: str = "bert") -> Any:
    """A lowercasing WordPiece tokenizer (BertTokenizerFast) trained on the corpus, saved to path.
    family xlm-roberta: XLM-R's special ids, and no token types (its tokenizer makes none)."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors, trainers
    from tokenizers.models import WordPiece
    from transformers import BertTokenizerFast

    tok = Tokenizer(WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    special = _SPECIAL if family == "bert" else _ROBERTA_SPECIAL
    tok.train_from_iterator(_CORPUS, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=special))
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    fast = BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]",
                             cls_token="[CLS]", mask_token="[MASK]", model_max_length=128,
                             **({} if family == "bert" else {"model_input_names": ["input_ids", "attention_mask"]}))
    fast.save_pretrained(str(path))
    return fast


def _config(family: str, tokenizer: Any, **overrides: Any) -> Any:
    from transformers import BertConfig, XLMRobertaConfig

    shape = {"vocab_size": len(tokenizer), "hidden_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 96, "hidden_act": "gelu", "pad_token_id": tokenizer.pad_token_id}
    if family == "bert":
        return BertConfig(max_position_embeddings=128, type_vocab_size=2, **shape, **overrides)
    # XLM-R's table: the longest prompt plus padding_idx + 1 rows
    return XLMRobertaConfig(max_position_embeddings=130, type_vocab_size=1, **shape, **overrides)


def _scale_up(model: torch.nn.Module, seed: int) -> None:
    """Weights drawn wider than the usual init (std 0.02), so the tokens' vectors differ
    clearly: a bug that mixes positions or sequences shows in the cosines."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen) if name.endswith("weight")
                        else 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))


def build_tiny_bert_embedder(path: Path, pooling_mode: str = "cls", normalize: bool = True, seed: int = 0,
                             family: str = "bert") -> Path:
    """A tiny random BertModel (family xlm-roberta: XLMRobertaModel) as sentence-transformers saves
    an embedder: the base model's weights (no "bert." prefix), modules.json,
    1_Pooling/config.json with pooling_mode, and a Normalize module when normalize."""
    path = Path(path)
    if (path / "modules.json").exists():
        return path
    from transformers import BertModel, XLMRobertaModel

    source = path.with_name(path.name + "-hf")
    tokenizer = build_bert_tokenizer(source, family=family)
    torch.manual_seed(seed)
    model = (BertModel if family == "bert" else XLMRobertaModel)(_config(family, tokenizer))
    _scale_up(model, seed)
    model.save_pretrained(str(source))
    return save_sentence_transformer(source, path, pooling_mode, normalize)


def build_tiny_bert_cross_encoder(path: Path, num_labels: int = 1, seed: int = 1, family: str = "bert") -> Path:
    """A tiny random BertForSequenceClassification with its tokenizer, as transformers saves a
    cross-encoder (ms-marco-MiniLM's layout: bert.* with the pooler, classifier.*); family
    xlm-roberta: XLMRobertaForSequenceClassification (bge-reranker-base's: roberta.*,
    classifier.dense and classifier.out_proj)."""
    path = Path(path)
    if (path / "config.json").exists():
        return path
    from transformers import BertForSequenceClassification, XLMRobertaForSequenceClassification

    tokenizer = build_bert_tokenizer(path, family=family)
    torch.manual_seed(seed)
    cls = BertForSequenceClassification if family == "bert" else XLMRobertaForSequenceClassification
    model = cls(_config(family, tokenizer, num_labels=num_labels))
    _scale_up(model, seed)
    model.save_pretrained(str(path))
    return path
