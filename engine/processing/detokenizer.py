"""Incremental detokenization that never emits half a UTF-8 character.

Decoding one token at a time is wrong for byte-level BPE (a character may span tokens) and
for SentencePiece (a leading space depends on the previous token). As in vLLM and TGI we
decode a short window twice, with and without the new tokens, and emit the difference only
once it no longer ends in U+FFFD (the replacement character of an incomplete sequence).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

_CONTEXT_TOKENS = 5  # prompt tokens kept as left context so the first word spaces right


def ids_decoder(tokenizer: Any) -> Callable[..., str]:
    """The tokenizer's decode(ids, skip_special_tokens=...), straight from its Rust backend when
    the transformers wrapper would add nothing to it (a fast tokenizer without space clean-up,
    as SmolLM2's BPE): the wrapper's Python layers cost little warm, but each decode runs them
    twice per token after a batch-1 step's weight stream, which leaves every cache cold."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return backend.decode
    return tokenizer.decode


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[..., str], prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        """decode: `ids_decoder(tokenizer)`, made once per tokenizer by the caller."""
        self._decode_ids = decode
        self._skip_special_tokens = skip_special_tokens
        self._tokens: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self.text = ""

    def _decode(self, token_ids: list[int]) -> str:
        return self._decode_ids(token_ids, skip_special_tokens=self._skip_special_tokens)

    def add_tokens(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly complete text (possibly empty)."""
        self._tokens.extend(token_ids)
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._tokens[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        self.text += delta
        return delta

    def truncate(self, num_chars: int) -> None:
        """Cut the text at a stop string; nothing after it is ever emitted."""
        self.text = self.text[:num_chars]
