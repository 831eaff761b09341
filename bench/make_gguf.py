"""Write a random-weight GGUF file of a model's shape, for speed runs on a larger model than the
default without a download: speed depends on shapes, not values.

    python -m bench.make_gguf --out /tmp/llama-1b-q4_0.gguf --type Q4_0
    python -m bench.make_gguf --out /tmp/llama-1b-q4_k_m.gguf --llama-quantize Q4_K_M --llama-cpp-python $VENV/bin/python
    python -m bench.make_gguf --out /tmp/smollm2-q4_k.gguf --requantize-default Q4_K

--llama-quantize writes the weights as F16, then has llama.cpp's own quantizer (llama-cpp-python's
llama_model_quantize, in the peer's venv) make the mixed k-quant file that users download: the
`gguf` package cannot write k-quants.

The shape is transformers' LlamaConfig of Llama-3.2-1B (hidden 2048, 16 layers, 32 heads, 8 KV heads,
MLP 8192, vocabulary 128256, tied embeddings); projections and the embedding hold random normal
weights quantized by the `gguf` package to --type, norms are float32. The tokenizer's metadata
is the default model's (its SmolLM2 vocabulary, padded with unused tokens to the shape's size),
so minivllm and llama.cpp both load the file.

--requantize-default TYPE writes the default model's own weights (its shipped file dequantized)
in TYPE instead: the real model in each block type, for quality checks (tests/engine/execution/weights/test_gguf_file.py
and `python -m bench.perplexity --model FILE --modes float32,gguf`). A matrix whose rows are not a
multiple of the type's block (SmolLM2's 576-wide rows against the k-quants' 256) takes Q8_0, as
llama.cpp's quantizer also falls back there; norms stay float32.
"""
from __future__ import annotations

import argparse
import logging
import os
import subprocess

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from bench.kquants import quantize_q4_k, quantize_q5_k, quantize_q6_k

logger = logging.getLogger("bench.make_gguf")

_UNUSED_TOKEN = 5  # llama.cpp's token type for a vocabulary slot no text maps to


def llama_3_2_1b_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
                       rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=500000.0)


def _copy_tokenizer(writer: GGUFWriter, source: GGUFReader, vocab_size: int) -> None:
    for field in source.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        value = field.contents()
        if field.name == "tokenizer.ggml.tokens":
            value = value + [f"<unused_{i}>" for i in range(len(value), vocab_size)]
        elif field.name == "tokenizer.ggml.token_type":
            value = value + [_UNUSED_TOKEN] * (vocab_size - len(value))
        sub_type = field.types[-1] if len(field.types) > 1 else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub_type)


# GGUF's general.file_type for a file mostly of one type (llama.h's llama_ftype)
_FILE_TYPES = {GGMLQuantizationType.F16: 1, GGMLQuantizationType.Q4_0: 2, GGMLQuantizationType.Q4_1: 3,
               GGMLQuantizationType.Q8_0: 7, GGMLQuantizationType.Q5_0: 8, GGMLQuantizationType.Q5_1: 9,
               GGMLQuantizationType.Q4_K: 14, GGMLQuantizationType.Q5_K: 16, GGMLQuantizationType.Q6_K: 18}
_KQUANTIZERS = {GGMLQuantizationType.Q4_K: quantize_q4_k, GGMLQuantizationType.Q5_K: quantize_q5_k,
                GGMLQuantizationType.Q6_K: quantize_q6_k}


def quantize_blocks(values: np.ndarray, quant_type: GGMLQuantizationType) -> np.ndarray:
    """[rows, k] float -> the file's blocks of quant_type (k-quants by bench.kquants)."""
    quantizer = _KQUANTIZERS.get(quant_type)
    return quantizer(values) if quantizer else quantize(values, quant_type)


def requantize_gguf(source: str, path: str, quant_type: GGMLQuantizationType,
                    only: str | None = None) -> dict[str, GGMLQuantizationType]:
    """source's model with every matrix requantized to quant_type (Q8_0 where its rows do not fit
    the type's block), its metadata as it was; -> each tensor's type in the new file. only: just
    the tensors whose names hold it (a mixed file, as llama.cpp's k-quant mixes are); the rest and
    the file type stay as they were."""
    reader = GGUFReader(source)
    architecture = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(path, architecture)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or (
                field.name == "general.file_type" and only is None):
            continue
        sub_type = field.types[-1] if len(field.types) > 1 else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    if only is None:
        writer.add_file_type(_FILE_TYPES[quant_type])
    types: dict[str, GGMLQuantizationType] = {}
    block = 256 if quant_type in _KQUANTIZERS else 32
    for t in reader.tensors:
        if only is not None and only not in t.name:
            kind = GGMLQuantizationType(t.tensor_type)
            is_float = kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=None if is_float else kind)
            types[t.name] = kind
            continue
        if len(t.shape) < 2:
            values = np.asarray(t.data, np.float32)
            writer.add_tensor(t.name, values)
            types[t.name] = GGMLQuantizationType.F32
            continue
        values = dequantize(t.data, t.tensor_type).reshape(int(t.shape[1]), int(t.shape[0]))
        kind = quant_type if values.shape[1] % block == 0 else GGMLQuantizationType.Q8_0
        writer.add_tensor(t.name, quantize_blocks(values, kind), raw_dtype=kind)
        types[t.name] = kind
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


def write_random_gguf(path: str, quant_type: GGMLQuantizationType, seed: int = 0) -> None:
    from engine.execution.weights.checkpoint import fetch_default_gguf

    cfg = llama_3_2_1b_config()
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(path, "llama")
    writer.add_name("random Llama-3.2-1B shape")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(_FILE_TYPES[quant_type])
    _copy_tokenizer(writer, GGUFReader(str(fetch_default_gguf())), cfg.vocab_size)

    def matrix(name: str, rows: int, cols: int) -> None:
        values = rng.standard_normal((rows, cols), dtype=np.float32) * 0.02
        if quant_type == GGMLQuantizationType.F16:
            writer.add_tensor(name, values.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(values, quant_type), raw_dtype=quant_type)

    hidden, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    matrix("token_embd.weight", cfg.vocab_size, hidden)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(cfg.num_hidden_layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        for name, rows, cols in (("attn_q", q, hidden), ("attn_k", kv, hidden), ("attn_v", kv, hidden),
                                 ("attn_output", hidden, q), ("ffn_gate", cfg.intermediate_size, hidden),
                                 ("ffn_up", cfg.intermediate_size, hidden), ("ffn_down", hidden, cfg.intermediate_size)):
            matrix(f"blk.{i}.{name}.weight", rows, cols)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# llama.cpp's llama_ftype values of the mixes its quantizer makes (llama.h)
_LLAMA_FTYPES = {"Q4_0": 2, "Q8_0": 7, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}
_QUANTIZE = """
import sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype, params.nthread = int(sys.argv[3]), 2
code = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params)
sys.exit(code)
"""


def llama_quantize(python: str, source: str, out: str, mix: str) -> None:
    """llama.cpp's quantizer, run by the peer's interpreter (its package never enters our venv)."""
    result = subprocess.run([python, "-c", _QUANTIZE, source, out, str(_LLAMA_FTYPES[mix])], check=False)
    if result.returncode != 0:
        raise RuntimeError(f"llama_model_quantize {source} -> {out} ({mix}) failed with code {result.returncode}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the .gguf file to write")
    parser.add_argument("--type", default="Q4_0", choices=["Q4_0", "Q4_1", "Q8_0"], help="the projections' block type")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--llama-quantize", choices=sorted(_LLAMA_FTYPES),
                        help="write F16, then quantize to this mix with llama.cpp's quantizer")
    parser.add_argument("--llama-cpp-python", help="the interpreter of a venv with llama-cpp-python")
    parser.add_argument("--requantize-default", choices=[t.name for t in _FILE_TYPES if t.name != "F16"],
                        help="the default model's real weights in this block type, instead of random ones")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.requantize_default is not None:
        from engine.execution.weights.checkpoint import fetch_default_gguf

        requantize_gguf(str(fetch_default_gguf()), args.out, GGMLQuantizationType[args.requantize_default])
    elif args.llama_quantize is None:
        write_random_gguf(args.out, GGMLQuantizationType[args.type], args.seed)
    elif args.llama_cpp_python is None:
        parser.error("--llama-quantize needs --llama-cpp-python (llama.cpp's quantizer runs in the peer's venv)")
    else:
        f16 = f"{args.out}.f16.tmp"
        try:
            write_random_gguf(f16, GGMLQuantizationType.F16, args.seed)
            llama_quantize(args.llama_cpp_python, f16, args.out, args.llama_quantize)
        finally:
            if os.path.exists(f16):
                os.unlink(f16)
    logger.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
