"""A BERT WordPiece tokenizer rebuilt from a GGUF file's metadata (tokenizer.ggml.model "bert").

transformers reads no tokenizer of this kind from a GGUF file, so it is rebuilt here as the
BertTokenizer a bge / e5 / all-MiniLM directory ships (BertNormalizer, BertPreTokenizer,
WordPiece with "##" continuations, [CLS] ... [SEP] around a text), from what llama.cpp's
converter stored:
- the tokens, rewritten to llama.cpp's "phantom space" form: a word-initial token gains a leading
  "\u2581", a "##" continuation loses its "##", and control tokens ([CLS], [SEP], [PAD], [UNK],
  [MASK]: the checkpoint's special added tokens) stay as they are. Undone here: "\u2581x" -> "x",
  a normal token without the mark -> "##" + it. (The rewrite is not one-to-one where a vocabulary
  holds both "x" and "##\u2581x": both are written "\u2581x", and the first id is kept for it.)
  The converter writes unused ids as "[PAD<id>]" of type unused: kept as tokens no text produces;
- the special ids: [CLS] as tokenizer.ggml.bos_token_id (older files: cls_token_id), [SEP] as
  seperator_token_id (llama.cpp's spelling; else eos_token_id), [UNK], [PAD] and [MASK] by theirs;
- the normaliser: tokenizer.ggml.normalizer.lowercase (and strip_accents), which the converter
  copies from tokenizer.json's BertNormalizer; a file without them is lowercased and stripped of
  accents, as llama.cpp reads such a file (and as strip_accents follows lowercase in BERT's
  normaliser when unset).
"""
from __future__ import annotations

from typing import Any

from engine.execution.weights.gguf_file import GGUFFile

PHANTOM_SPACE = "\u2581"  # llama.cpp's mark of a word's first token
# gguf's TokenType of the tokens the converter leaves unrewritten
_CONTROL, _UNUSED = 3, 5
# token role -> the metadata keys of its id, first found wins, and BERT's own text of the token
_SPECIAL_KEYS = {"cls_token": (("bos_token_id", "cls_token_id"), "[CLS]"),
                 "sep_token": (("seperator_token_id", "eos_token_id"), "[SEP]"),
                 "unk_token": (("unknown_token_id",), "[UNK]"),
                 "pad_token": (("padding_token_id",), "[PAD]"),
                 "mask_token": (("mask_token_id",), "[MASK]")}


def wordpiece_vocab(tokens: list[str], token_types: list[int]) -> list[str]:
    """The WordPiece vocabulary (id order) of the converter's phantom-space tokens."""
    if len(tokens) != len(token_types):
        raise ValueError(f"model: GGUF file has {len(tokens)} tokens but {len(token_types)} token types")
    vocab = []
    for token, kind in zip(tokens, token_types, strict=True):
        if kind in (_CONTROL, _UNUSED):
            vocab.append(token)
        elif token.startswith(PHANTOM_SPACE):
            vocab.append(token[len(PHANTOM_SPACE):])
        else:
            vocab.append("##" + token)
    return vocab


def gguf_wordpiece_tokenizer(file: GGUFFile) -> Any:
    """transformers' BertTokenizer of file's vocabulary, special tokens and normaliser (module
    docstring). ValueError for a file that is not WordPiece's or lacks its vocabulary."""
    from transformers import BertTokenizer

    model = file.field("tokenizer.ggml.model")
    if model != "bert":
        raise ValueError(f"model: GGUF file {file.path.name} has tokenizer {model!r}, not WordPiece (bert)")
    tokens = [str(t) for t in file.field("tokenizer.ggml.tokens", [])]
    if not tokens:
        raise ValueError(f"model: GGUF file {file.path.name} has no tokenizer.ggml.tokens")
    vocab = wordpiece_vocab(tokens, [int(t) for t in file.field("tokenizer.ggml.token_type", [])])
    ids: dict[str, int] = {}
    for index, token in enumerate(vocab):
        ids.setdefault(token, index)  # a repeated text keeps its first id, as a vocab.txt reads
    special = {}
    for role, (keys, default) in _SPECIAL_KEYS.items():
        index = next((file.field(f"tokenizer.ggml.{key}") for key in keys
                      if file.field(f"tokenizer.ggml.{key}") is not None), None)
        special[role] = vocab[int(index)] if index is not None and 0 <= int(index) < len(vocab) else default
    lowercase = bool(file.field("tokenizer.ggml.normalizer.lowercase", True))
    strip_accents = bool(file.field("tokenizer.ggml.normalizer.strip_accents", lowercase))
    max_length = int(file.arch_field("context_length", 512))
    return BertTokenizer(vocab=ids, do_lower_case=lowercase, strip_accents=strip_accents,
                         model_max_length=max_length, **special)
