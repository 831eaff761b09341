"""A GGUF file carrying gpt-oss's tokenizer as llama.cpp writes one (architecture gpt-oss,
tokenizer model gpt2 with pre-tokenizer gpt-4o: o200k's ranked tokens spelled byte-level, then
Harmony's specials up to id 201,087, and the BPE merges), and no weights: what the server reads
a gpt-oss GGUF file's tokenizer from. Built once from o200k's tokens (tests/o200k_vocab.py) into
the project's cache (the merges take a while to derive)."""
from __future__ import annotations

import os
from pathlib import Path

from engine.config import default_cache_dir
from service.chat.harmony_vocab import NUM_RANKS, byte_level_decoder
from tests.o200k_vocab import o200k_ranked_tokens

VOCAB_SIZE = 201_088
SPECIALS = {199_998: "<|startoftext|>", 199_999: "<|endoftext|>", 200_002: "<|return|>", 200_003: "<|constrain|>",
            200_005: "<|channel|>", 200_006: "<|start|>", 200_007: "<|end|>", 200_008: "<|message|>",
            200_012: "<|call|>", 200_018: "<|endofprompt|>"}


def _merge_of(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two tokens BPE joins into token: its bytes merged by rank, only ranks below its own."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        best, at = rank, -1
        for i in range(len(parts) - 1):
            joined = ranks.get(parts[i] + parts[i + 1], rank)
            if joined < best:
                best, at = joined, i
        if at < 0:
            raise ValueError(f"token {rank} is not reachable by merges")
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    return parts[0], parts[1]


def gpt_oss_tokenizer_gguf() -> Path:
    import gguf

    path = default_cache_dir() / "o200k-gguf" / "gpt-oss-tokenizer.gguf"
    if path.exists():
        return path
    tokens = o200k_ranked_tokens()
    ranks = {t: i for i, t in enumerate(tokens)}
    encoder = {b: c for c, b in byte_level_decoder().items()}

    def spell(token: bytes) -> str:
        return "".join(encoder[b] for b in token)

    merges = [" ".join(spell(p) for p in _merge_of(t, r, ranks)) for r, t in enumerate(tokens) if len(t) > 1]
    names = [spell(t) for t in tokens] + [SPECIALS.get(i, f"<|reserved_{i}|>") for i in range(NUM_RANKS, VOCAB_SIZE)]
    types = [gguf.TokenType.NORMAL] * NUM_RANKS + [gguf.TokenType.CONTROL] * (VOCAB_SIZE - NUM_RANKS)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), "gpt-oss")
    writer.add_context_length(4096)
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_feed_forward_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_expert_count(4)
    writer.add_expert_used_count(2)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-4o")
    writer.add_token_list(names)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(199_998)
    writer.add_eos_token_id(200_002)
    writer.add_pad_token_id(199_999)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(path)  # whole or not at all
    return path
