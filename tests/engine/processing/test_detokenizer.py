"""Incremental detokenization never emits half a character."""
from __future__ import annotations

from engine.processing.detokenizer import IncrementalDetokenizer, TokenDecoder, engine_decoder


def _no_second_tokenizer():
    raise AssertionError("a second tokenizer was loaded where the TokenDecoder serves")


def test_multibyte_characters_are_never_split(tiny_llm) -> None:
    tok = tiny_llm.tokenizer
    text = "naïve 你好世界 🙂 done"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(engine_decoder(tok, _no_second_tokenizer), [], skip_special_tokens=True)
    deltas = [detok.add_tokens([t]) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text == detok.text
    # Some character really spanned tokens, or the test would prove nothing.
    assert any(d == "" for d in deltas)


def test_the_engine_thread_loads_no_second_tokenizer_where_the_wrapper_adds_nothing(tiny_llm) -> None:
    import copy
    import random

    tok = tiny_llm.tokenizer
    assert tok.clean_up_tokenization_spaces is False
    decode = engine_decoder(tok, _no_second_tokenizer)
    assert isinstance(decode, TokenDecoder) and isinstance(tiny_llm.engine._decode_ids, TokenDecoder)
    rng = random.Random(0)
    special = sorted(tok.all_special_ids)
    for _ in range(300):  # what the wrapper's decode gives, as users of the tokenizer see it
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 8))] + [rng.choice(special)]
        rng.shuffle(ids)
        for skip in (True, False):
            assert decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)
    cleaning = copy.deepcopy(tok)
    cleaning.clean_up_tokenization_spaces = True  # the wrapper's clean-up must then run, on a tokenizer of its own
    own = copy.deepcopy(cleaning)
    assert engine_decoder(cleaning, lambda: own) == own.decode


def _decodes_as_the_backend(tok, num_cases: int = 300) -> None:
    import random

    decode = TokenDecoder.of(tok)
    assert decode is not None
    backend = tok.backend_tokenizer
    rng = random.Random(1)
    special = sorted(tok.all_special_ids)
    size = backend.get_vocab_size(with_added_tokens=True)
    for _ in range(num_cases):
        ids = [rng.randrange(size) for _ in range(rng.randint(1, 8))] + [rng.choice(special), size + 3]
        rng.shuffle(ids)  # size + 3: an id past the vocabulary (a padded LM head's), dropped by both
        for skip in (True, False):
            assert decode(ids, skip_special_tokens=skip) == backend.decode(ids, skip_special_tokens=skip), ids


def test_the_engine_threads_decoder_decodes_as_the_rust_tokenizer(tiny_llm) -> None:
    """Byte-level BPE (the tiny model's: SmolLM2's kind), special tokens and unknown ids."""
    _decodes_as_the_backend(tiny_llm.tokenizer)


def test_the_token_decoder_runs_a_sentencepiece_style_decoder_chain(tmp_path) -> None:
    """Metaspace-style pieces (U+2581 for spaces) and byte fallback, as Gemma's and Llama 2's
    vocabularies decode: the decoder chain (replace, byte fallback, fuse) must run, not a join."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3, "a": 4, "b": 5, "ab": 6, "ba": 7, "▁ab": 264}
    vocab |= {f"<0x{i:02X}>": 8 + i for i in range(256)}
    backend = Tokenizer(models.BPE(vocab, [("a", "b"), ("b", "a"), ("▁", "ab")], unk_token="<unk>",
                                   byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                  clean_up_tokenization_spaces=False)
    ids = tok.encode("ab ba é", add_special_tokens=False)
    assert any(8 <= i < 264 for i in ids)  # é went through byte fallback, or the chain was not tested
    assert TokenDecoder.of(tok)(ids, skip_special_tokens=True) == backend.decode(ids) == "ab ba é"
    _decodes_as_the_backend(tok)
