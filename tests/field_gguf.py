"""GGUF files as the field writes them: tiny random Hugging Face checkpoints of Qwen3, Qwen3-MoE and Gemma 3
(and a Qwen3 embedder as sentence-transformers saves one: the converter writes its pooling_type),
with the tokenizers their real repositories ship (Qwen2's byte-level BPE, Gemma's SentencePiece
model), converted by llama.cpp's own convert_hf_to_gguf.py (from llama-cpp-python's sdist, run
unchanged in a subprocess).

- Qwen3: the converter identifies a BPE tokenizer by hashing its ids for a fixed text, so a tiny
  trained vocabulary is refused; the checkpoint gets the real Qwen2 vocabulary instead, read by
  transformers from the sdist's models/ggml-vocab-qwen2.gguf (llama.cpp's tokenizer test file:
  151,936 tokens, so the tiny model's embedding is 151,936 x 64), and Qwen3-0.6B's chat template.
  That tokenizer is built once into the project's cache (it takes transformers half a minute).
- BERT embedders ("bert-embed": mean pooling, "bert-embed-cls": CLS; Normalize after both) and a
  BERT cross-encoder ("bert-rerank"): the converter identifies a WordPiece tokenizer by the same
  hash, so the checkpoints get bge-small's real 30,522-token vocabulary, read from the sdist's
  models/ggml-vocab-bert-bge.gguf (its tokens in llama.cpp's phantom-space form, turned back into
  vocab.txt's here) as transformers' BertTokenizer; the converter accepting it shows that
  tokenizer encodes its check text as bge's does.
- Gemma 3: a SentencePiece BPE model trained here on tests.tiny_model's corpus, laid out as
  Gemma's (<pad> <eos> <bos> <unk> first, <start_of_turn> / <end_of_turn>, byte fallback, no
  dummy prefix), its tokenizer_config listing the special tokens as Gemma's repositories do (the
  converter types them from there), and Gemma 2's chat template (the sdist has no Gemma 3 one; the
  turn markup is the same).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.config import default_cache_dir
from tests.llama_cpp_sdist import chat_template, llama_cpp_sdist
from tests.tiny_model import _CORPUS

LLAMA_CPP = Path("vendor/llama.cpp")  # in the unpacked sdist
_WEIGHTS = Path(__file__).parent.parent / "engine" / "execution" / "weights"
_KEYED_SOURCES = (Path(__file__), _WEIGHTS / "checkpoint.py", _WEIGHTS / "gguf_config.py", _WEIGHTS / "gguf_file.py",
                  _WEIGHTS / "pooling_config.py", _WEIGHTS / "gguf_wordpiece.py", _WEIGHTS / "gguf_loader.py")
BGE_VOCAB = LLAMA_CPP / "models" / "ggml-vocab-bert-bge.gguf"  # in the unpacked sdist; .inp / .out beside it
OUTTYPES = ("f32", "f16", "bf16", "q8_0")


def convert_hf_to_gguf(hf_dir: Path, out: Path, outtype: str) -> Path:
    """hf_dir converted by llama.cpp's convert_hf_to_gguf.py to out, its tensors in outtype (the
    converter keeps norms and other 1-D tensors float32). Runs with this interpreter and the sdist's
    own gguf-py, as llama.cpp's instructions do."""
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype: {outtype!r} is not one of {OUTTYPES}")
    llama_cpp = llama_cpp_sdist() / LLAMA_CPP
    env = os.environ | {"PYTHONPATH": str(llama_cpp / "gguf-py")}
    run = subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", outtype,
                          "--outfile", str(out)], env=env, capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_dir} ({outtype}):\n{run.stderr[-4000:]}")
    return out


def _random_weights(model: Any, seed: int, norm_center: float, embed_std: float) -> None:
    """Well-separated random weights (see tests.tiny_model); norms near norm_center, not on it, so a
    misplaced or unshifted norm weight shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(norm_center + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * (embed_std if "embed_tokens" in name else 0.25))


def qwen2_tokenizer_dir() -> Path:
    """The real Qwen2 / Qwen3 tokenizer (from the sdist's vocabulary test file) with Qwen3-0.6B's
    chat template and <|im_end|> as its eos, as Qwen3's instruct repositories have them; built once."""
    target = default_cache_dir() / "test-tokenizers" / "qwen2"
    if (target / "tokenizer.json").exists():
        return target
    from transformers import AutoTokenizer

    models = llama_cpp_sdist() / LLAMA_CPP / "models"
    tokenizer = AutoTokenizer.from_pretrained(str(models), gguf_file="ggml-vocab-qwen2.gguf")
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = chat_template("Qwen-Qwen3-0.6B")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tokenizer.save_pretrained(tmp)
        try:
            Path(tmp).rename(target)
        except OSError:  # built meanwhile by another process
            if not (target / "tokenizer.json").exists():
                raise
    return target


def _save_random_checkpoint(config: Any, tokenizer: Any, path: Path, seed: int) -> Path:
    """A checkpoint of config's model with random weights (norms near 1) and tokenizer at path."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    _random_weights(model, seed, norm_center=1.0, embed_std=1.0)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


def build_qwen3_checkpoint(path: Path, tie_word_embeddings: bool = False, seed: int = 0) -> Path:
    """A 2-layer Qwen3 of hidden size 64 whose heads are 32 wide (4 x 32 = 128 != 64: the file's
    attention.key_length matters), with the real Qwen tokenizer."""
    from transformers import AutoTokenizer, Qwen3Config

    tokenizer = AutoTokenizer.from_pretrained(str(qwen2_tokenizer_dir()))
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                         rms_norm_eps=1e-6, tie_word_embeddings=tie_word_embeddings,
                         bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                         eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                         pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    return _save_random_checkpoint(config, tokenizer, path, seed)


def build_qwen3_embedder_checkpoint(path: Path, seed: int = 0) -> Path:
    """A 2-layer Qwen3 embedder as sentence-transformers saves one (Qwen3-Embedding's layout: the
    base model's weights, tied embeddings, modules.json, last-token pooling, Normalize), of hidden
    size 64 with heads 32 wide and the real Qwen tokenizer without a chat template
    (sentence-transformers renders a text through one where the tokenizer has it)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import AutoTokenizer, Qwen3Config, Qwen3Model

    tokenizer = AutoTokenizer.from_pretrained(str(qwen2_tokenizer_dir()))
    tokenizer.chat_template = None
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                         rms_norm_eps=1e-6, tie_word_embeddings=True,
                         bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                         eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                         pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    torch.manual_seed(seed)
    model = Qwen3Model(config)
    _random_weights(model, seed, norm_center=1.0, embed_std=1.0)
    base = path.with_name(path.name + "-base")
    model.save_pretrained(str(base))
    tokenizer.save_pretrained(str(base))
    transformer = Transformer(str(base))
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode="lasttoken"), Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(path))
    return path


def bge_vocab() -> list[str]:
    """bge-small's WordPiece vocabulary (id order) from the sdist's llama.cpp vocabulary file. That
    file was written by an older converter, which left [unusedN] unmarked; its other tokens are in
    the phantom-space form: a word's first token marked with U+2581, a continuation without its
    "##", control tokens as they are."""
    from gguf import GGUFReader

    reader = GGUFReader(str(llama_cpp_sdist() / BGE_VOCAB))
    tokens = reader.get_field("tokenizer.ggml.tokens").contents()
    types = reader.get_field("tokenizer.ggml.token_type").contents()
    control = 3
    vocab = []
    for token, kind in zip(tokens, types, strict=True):
        if kind == control or (token.startswith("[unused") and token.endswith("]")):
            vocab.append(token)
        else:
            vocab.append(token[1:] if token.startswith("\u2581") else "##" + token)
    return vocab


def _save_random_bert(model_class: Any, path: Path, seed: int, **overrides: Any) -> Path:
    """A 2-layer model_class (BertModel, BertForSequenceClassification) of hidden size 64 (4 heads;
    Q8_0's 32-wide blocks fit its rows) with bge-small's tokenizer (bge_vocab), random weights
    wider than the usual init (std 0.02) and LayerNorms near 1 and 0, so a misplaced tensor shows."""
    from transformers import BertConfig, BertTokenizer

    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(bge_vocab()) + "\n", encoding="utf-8")
    tokenizer = BertTokenizer(vocab=str(path / "vocab.txt"), do_lower_case=True, model_max_length=512)
    tokenizer.save_pretrained(str(path))
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, hidden_act="gelu", max_position_embeddings=128, type_vocab_size=2,
                        pad_token_id=tokenizer.pad_token_id, **overrides)
    torch.manual_seed(seed)
    model = model_class(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "LayerNorm" in name:
                center = 1.0 if name.endswith("weight") else 0.0
                param.copy_(center + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(str(path))
    return path


def build_bert_embedder_checkpoint(path: Path, pooling_mode: str = "mean", seed: int = 0) -> Path:
    """_save_random_bert's BertModel saved by sentence-transformers with pooling_mode and Normalize,
    as bge / e5 / all-MiniLM ship."""
    from transformers import BertModel

    from tests.tiny_model import save_sentence_transformer

    base = _save_random_bert(BertModel, path.with_name(path.name + "-base"), seed)
    return save_sentence_transformer(base, path, pooling_mode, normalize=True)


def build_bert_cross_encoder_checkpoint(path: Path, seed: int = 1) -> Path:
    """_save_random_bert's BertForSequenceClassification of one label (ms-marco-MiniLM's layout)."""
    from transformers import BertForSequenceClassification

    return _save_random_bert(BertForSequenceClassification, path, seed, num_labels=1)


def build_gpt_oss_checkpoint(path: Path, seed: int = 0) -> Path:
    """A 4-layer gpt-oss (window 8 and full layers alternating, 4 experts with 2 a token, YaRN,
    sinks) of hidden size 64, with the real Qwen tokenizer standing in for o200k (the converter
    identifies a tokenizer by hashing it; the sdist has no o200k vocabulary)."""
    from transformers import AutoTokenizer, GptOssConfig

    tokenizer = AutoTokenizer.from_pretrained(str(qwen2_tokenizer_dir()))
    config = GptOssConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=32, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                          num_local_experts=4, num_experts_per_tok=2, sliding_window=8, tie_word_embeddings=False,
                          rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                                           "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                           "original_max_position_embeddings": 128},
                          bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                          eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                          pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    return _save_random_checkpoint(config, tokenizer, path, seed)


def openai_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., K] (K a multiple of 32) as OpenAI's MXFP4 checkpoint tensors: blocks [..., K / 32, 16]
    uint8 (two E2M1 codes a byte, the even k in the low nibble) and scales [..., K / 32] uint8 (E8M0
    exponents, 2^(e - 127)). The codes and exponents are the gguf package's MXFP4 quantization of
    weight, moved from ggml's block (the exponent, then k and k + 16 in a byte's low and high nibble)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    *lead, k = weight.shape
    ggml = quantize(weight.float().reshape(-1, k).numpy(), GGMLQuantizationType.MXFP4).reshape(*lead, k // 32, 17)
    qs = ggml[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [..., 32]: the block's k in order
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return torch.from_numpy(np.ascontiguousarray(blocks)), torch.from_numpy(np.ascontiguousarray(ggml[..., 0]))


def build_gpt_oss_mxfp4_checkpoint(path: Path, seed: int = 0) -> Path:
    """build_gpt_oss_checkpoint's model with its experts' weights in MXFP4 as OpenAI released gpt-oss:
    mlp.experts.gate_up_proj_blocks / _scales ([E, 2I, H / 32, ...]: the rows transformers' [E, H, 2I]
    holds as columns, gate and up alternating) and down_proj_blocks / _scales ([E, H, I / 32, ...]),
    quantization_config mxfp4; the rest (biases included) as before. llama.cpp's converter keeps
    such experts' blocks as GGUF MXFP4 (it writes no MXFP4 from float weights)."""
    from safetensors.torch import load_file, save_file

    build_gpt_oss_checkpoint(path, seed)
    state = load_file(str(path / "model.safetensors"))
    for name in [n for n in state if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        blocks, scales = openai_mxfp4(state.pop(name).transpose(1, 2))  # [E, out, in]: a row per output
        state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def build_qwen3moe_checkpoint(path: Path, seed: int = 0) -> Path:
    """A 2-layer Qwen3-MoE (both layers sparse, as llama.cpp's qwen3moe runs every layer: 8 experts
    of width 32, 2 a token, their weights renormalised as the released checkpoints and llama.cpp do)
    of hidden size 64, heads 32 wide, with the real Qwen tokenizer."""
    from transformers import AutoTokenizer, Qwen3MoeConfig

    tokenizer = AutoTokenizer.from_pretrained(str(qwen2_tokenizer_dir()))
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
                            bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                            pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    return _save_random_checkpoint(config, tokenizer, path, seed)


GEMMA_SPECIAL = ("<pad>", "<eos>", "<bos>", "<unk>")
GEMMA_TURNS = ("<start_of_turn>", "<end_of_turn>")


def build_gemma3_checkpoint(path: Path, seed: int = 0) -> Path:
    """A 6-layer Gemma 3 (layers 0-4 sliding over 8 tokens, layer 5 global: llama.cpp takes every
    sixth layer for global, whatever the config says) of hidden size 64, heads 32 wide, with a tiny
    Gemma-style SentencePiece tokenizer."""
    import sentencepiece
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, GemmaTokenizer

    path.mkdir(parents=True, exist_ok=True)
    model_file = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_CORPUS.splitlines() * 4), model_writer=model_file, model_type="bpe", vocab_size=400,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>",
        unk_piece="<unk>", user_defined_symbols=list(GEMMA_TURNS), byte_fallback=True, add_dummy_prefix=False,
        remove_extra_whitespaces=False, normalization_rule_name="identity", split_digits=True,
        allow_whitespace_only_pieces=True, character_coverage=1.0, minloglevel=2)
    (path / "tokenizer.model").write_bytes(model_file.getvalue())
    tokenizer = GemmaTokenizer.from_pretrained(str(path), add_bos_token=True)
    tokenizer.chat_template = chat_template("google-gemma-2-2b-it")
    tokenizer.save_pretrained(str(path))
    # Gemma's repositories list their special tokens in tokenizer_config.json (transformers 5 no
    # longer writes them there): llama.cpp's converter takes their control type from this list
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    tokenizer_config.pop("vocab_file", None)
    tokenizer_config["added_tokens_decoder"] = {
        str(i): {"content": tokenizer.convert_ids_to_tokens(i), "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for i in sorted(tokenizer.convert_tokens_to_ids([*GEMMA_SPECIAL, *GEMMA_TURNS, "<mask>"]))}
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    config = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
                              sliding_window=8, max_position_embeddings=1024, rms_norm_eps=1e-6,
                              tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    # Gemma scales norms by 1 + w, and its embeddings by sqrt(hidden) = 8: an embedding of the
    # usual scale outweighs the layers' (normed) outputs, and every prompt's greedy answer is its
    # last token repeated (so at 1.0 and 0.5); at 1 / 8 the layers choose
    _random_weights(model, seed, norm_center=0.0, embed_std=0.125)
    model.save_pretrained(str(path))
    return path


def field_gguf(family: str, outtype: str) -> tuple[Path, Path]:
    """(the GGUF file llama.cpp's converter writes of family's tiny checkpoint in outtype, that
    checkpoint's directory), made once into the project's cache under a key of this module's text
    and of the code that reads GGUF metadata and converts its tensors: the engine caches what it
    derives from a file by the file's path and time, so a change there must come with new files, or
    a test would meet the old code's config, tokenizer or converted weights (quantization none's
    safetensors, which gguf_loader.hf_float_tensors writes for bert and gpt-oss)."""
    builders = {"qwen3": build_qwen3_checkpoint, "qwen3-embed": build_qwen3_embedder_checkpoint,
                "qwen3moe": build_qwen3moe_checkpoint, "gemma3": build_gemma3_checkpoint,
                "gpt-oss": build_gpt_oss_checkpoint, "gpt-oss-mxfp4": build_gpt_oss_mxfp4_checkpoint,
                "bert-embed": build_bert_embedder_checkpoint,
                "bert-embed-cls": lambda path: build_bert_embedder_checkpoint(path, pooling_mode="cls"),
                "bert-rerank": build_bert_cross_encoder_checkpoint}
    key = hashlib.sha256(b"".join(path.read_bytes() for path in _KEYED_SOURCES)).hexdigest()[:12]
    root = default_cache_dir() / "field-gguf" / key
    root.mkdir(parents=True, exist_ok=True)
    hf_dir = root / f"{family}-hf"
    if not (hf_dir / "config.json").exists():
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            builders[family](Path(tmp) / "hf")
            _publish(Path(tmp) / "hf", hf_dir)
    out = root / f"{family}-{outtype}.gguf"
    if not out.exists():
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            _publish(convert_hf_to_gguf(hf_dir, Path(tmp) / out.name, outtype), out)
    return out, hf_dir


def _publish(made: Path, target: Path) -> None:
    """made renamed to target, whole; another process may have put it there first."""
    try:
        made.rename(target)
    except OSError:
        if not target.exists():
            raise
