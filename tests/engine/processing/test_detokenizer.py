"""Incremental detokenization never emits half a character."""
from __future__ import annotations

from engine.processing.detokenizer import IncrementalDetokenizer, ids_decoder


def test_multibyte_characters_are_never_split(tiny_llm) -> None:
    tok = tiny_llm.tokenizer
    text = "naïve 你好世界 🙂 done"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(ids_decoder(tok), [], skip_special_tokens=True)
    deltas = [detok.add_tokens([t]) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text == detok.text
    # Some character really spanned tokens, or the test would prove nothing.
    assert any(d == "" for d in deltas)


def test_decoding_skips_the_wrapper_only_where_the_wrapper_adds_nothing(tiny_llm) -> None:
    import copy
    import random

    tok = tiny_llm.tokenizer
    assert tok.clean_up_tokenization_spaces is False
    decode = ids_decoder(tok)
    assert decode == tok.backend_tokenizer.decode
    rng = random.Random(0)
    special = sorted(tok.all_special_ids)
    for _ in range(300):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 8))] + [rng.choice(special)]
        rng.shuffle(ids)
        for skip in (True, False):
            assert decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)
    cleaning = copy.deepcopy(tok)
    cleaning.clean_up_tokenization_spaces = True  # the wrapper's clean-up must then run
    assert ids_decoder(cleaning) == cleaning.decode
