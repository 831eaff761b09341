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


def engine_decoder(tokenizer: Any, load_own: Callable[[], Any]) -> Callable[..., str]:
    """The engine thread's decode(ids, skip_special_tokens=...) for the input side's tokenizer: a
    TokenDecoder where the Rust backend's decode is all the tokenizer's decode runs (a fast
    tokenizer without space clean-up, as the LLMs served here), else the decode of a tokenizer of
    its own (load_own()), since the input side's must stay on its thread."""
    decoder = TokenDecoder.of(tokenizer)
    return decoder if decoder is not None else load_own().decode


class TokenDecoder:
    """A fast tokenizer's Rust decode (ids -> text), from its vocabulary and its decoder alone.

    Why: the engine thread must not share the input side's tokenizer (transformers sets its
    truncation and padding, a mutable borrow, on each call, which fails against a decode in
    flight on another thread), and a second whole tokenizer costs its memory twice: 70-90 MB
    resident for o200k's 201k entries and merges. This holds each id's token and the decoder
    (read-only, shared safely), and decodes as tokenizers' Tokenizer.decode does: an added
    token's content, else the model's; special ones dropped when asked; then the decoder, or the
    tokens joined by spaces where there is none. Ids with no token (an LM head padded past the
    vocabulary) are dropped, as there."""

    def __init__(self, backend: Any) -> None:
        vocab: dict[str, int] = backend.get_vocab(with_added_tokens=True)
        added_tokens = backend.get_added_tokens_decoder()  # {id: AddedToken}
        tokens: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
        for token, token_id in vocab.items():
            tokens[token_id] = token
        for token_id, added in added_tokens.items():  # an added token's content wins
            tokens[token_id] = added.content
        self._tokens = tokens
        self._special = frozenset(i for i, added in added_tokens.items() if added.special)
        self._decoder = backend.decoder

    @classmethod
    def of(cls, tokenizer: Any) -> TokenDecoder | None:
        """One for tokenizer where its decode is the Rust backend's alone (no space clean-up by the
        transformers wrapper), else None."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True) is not False:
            return None
        return cls(backend)

    def __call__(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        tokens, special, num_tokens = self._tokens, self._special, len(self._tokens)
        pieces = [tokens[i] for i in token_ids
                  if 0 <= i < num_tokens and tokens[i] is not None and not (skip_special_tokens and i in special)]
        return self._decoder.decode(pieces) if self._decoder is not None else " ".join(pieces)


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[..., str], prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        """decode: `engine_decoder(...)`, made once per tokenizer by the caller."""
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
