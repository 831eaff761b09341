"""Incremental detokenization never emits half a character."""
from __future__ import annotations

from engine.detokenizer import IncrementalDetokenizer


def test_multibyte_characters_are_never_split(tiny_llm) -> None:
    tok = tiny_llm.tokenizer
    text = "naïve 你好世界 🙂 done"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    deltas = [detok.add_tokens([t]) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text == detok.text
    # Some character really spanned tokens, or the test would prove nothing.
    assert any(d == "" for d in deltas)
