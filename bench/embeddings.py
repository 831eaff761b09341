"""Embedding throughput: the same passages through LLM.embed and sentence-transformers' encode()
on the same threads, in one run, printing prompt tokens/s of each, their ratio, and how far the
vectors are apart (the least cosine).

    python -m bench.embeddings --num-passages 64 --min-tokens 64 --max-tokens 512

The model is a random-weight Qwen3 decoder embedder of Qwen3-Embedding-0.6B's shape (28 layers,
hidden 1024, 16 query / 8 KV heads of 128, MLP 3072; last-token pooling, normalised), saved by
sentence-transformers itself (modules.json, 1_Pooling, Normalize) in --work-dir and reused. Its
vocabulary is a BPE trained here on a generated corpus (--vocab-size, default 4096) instead of
Qwen's 151,669 entries: the vocabulary only sizes the embedding lookup, which costs nothing
beside the layers, and no download is needed. Both sides run float32. Speed depends on shapes,
not values.
"""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import numpy as np
import torch

_WORDS = ("the quick brown fox jumps over lazy dog paged cache stores keys values blocks prefill "
          "decode token model server request batch stream embedding vector query passage search "
          "retrieval rank score document answer question river mountain city music science history "
          "language number seven forty hundred thousand cafe naive world hello").split()


def build_embedder(path: Path, num_layers: int, hidden: int, vocab_size: int, seed: int = 0) -> Path:
    """A random Qwen3 embedder of the given shape, as sentence-transformers saves one."""
    if (path / "modules.json").exists():
        return path
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3Model

    base = path.with_name(path.name + "-base")
    base.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    rng = random.Random(seed)
    tok.train_from_iterator([" ".join(rng.choices(_WORDS, k=200)) for _ in range(200)], trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>").save_pretrained(
        str(base))
    config = Qwen3Config(vocab_size=tok.get_vocab_size(), hidden_size=hidden, intermediate_size=3 * hidden,
                         num_hidden_layers=num_layers, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    torch.manual_seed(seed)
    Qwen3Model(config).save_pretrained(str(base))
    transformer = Transformer(str(base))
    SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode="lasttoken"),
                                 Normalize()], device="cpu").save(str(path))
    return path


def passages(tokenizer: object, num: int, min_tokens: int, max_tokens: int, seed: int) -> list[str]:
    """Texts of min..max tokens each (by the model's tokenizer), words drawn at random."""
    rng = random.Random(seed)
    texts = []
    for _ in range(num):
        target = rng.randint(min_tokens, max_tokens)
        words = rng.choices(_WORDS, k=target)
        while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) > target:
            words = words[: int(len(words) * 0.9)]
        texts.append(" ".join(words))
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-passages", type=int, default=64)
    parser.add_argument("--min-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=None, help="both sides' threads (default: every usable CPU)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="minivllm's step budget")
    parser.add_argument("--st-batch-size", type=int, default=32, help="sentence-transformers' batch")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/minivllm-bench-embeddings"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from sentence_transformers import SentenceTransformer

    from engine import LLM
    from engine.config import usable_cpus

    threads = args.threads or usable_cpus()
    torch.set_num_threads(threads)
    model_dir = build_embedder(args.work_dir / f"qwen3-embed-{args.layers}x{args.hidden}", args.layers, args.hidden,
                               args.vocab_size, args.seed)
    reference = SentenceTransformer(str(model_dir), device="cpu", model_kwargs={"dtype": torch.float32})
    texts = passages(reference.tokenizer, args.num_passages, args.min_tokens, args.max_tokens, args.seed)
    num_tokens = sum(len(reference.tokenizer(t)["input_ids"]) for t in texts)

    llm = LLM(str(model_dir), num_threads=threads, max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=256, enable_prefix_caching=False)
    llm.embed(texts[:2])  # warm-up: the first steps' one-time costs
    reference.encode(texts[:2], batch_size=args.st_batch_size)
    t0 = time.perf_counter()
    ours = np.array([o.embedding for o in llm.embed(texts)])
    t_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    theirs = reference.encode(texts, batch_size=args.st_batch_size)
    t_theirs = time.perf_counter() - t0
    cosines = (ours * theirs).sum(-1) / np.linalg.norm(ours, axis=-1) / np.linalg.norm(theirs, axis=-1)
    print(f"{args.num_passages} passages of {args.min_tokens}-{args.max_tokens} tokens ({num_tokens} tokens), "
          f"{args.layers} layers x {args.hidden}, float32, {threads} threads")
    print(f"minivllm LLM.embed:          {num_tokens / t_ours:8.1f} tokens/s ({t_ours:.1f} s)")
    print(f"sentence-transformers encode: {num_tokens / t_theirs:8.1f} tokens/s ({t_theirs:.1f} s, batch "
          f"{args.st_batch_size})")
    print(f"ratio {t_theirs / t_ours:.2f}x; least cosine between the two {cosines.min():.6f}")


if __name__ == "__main__":
    main()
