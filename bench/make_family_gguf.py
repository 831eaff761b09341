"""Random-weight GGUF files of real model shapes in other families than Llama, made the way users'
files are made: a Hugging Face checkpoint (bf16 safetensors, config from transformers' own config
class) converted by llama.cpp's convert_hf_to_gguf.py, then quantized by llama.cpp's quantizer.
Speed depends on shapes and block types, not on values, so these stand in for the real models in
the side-by-side runs against llama.cpp without a download.

    # the peer, built from source without AMX (its AMX path crashed on an AMX machine) so one
    # build serves both: AVX-512 (VNNI, BF16), AVX2, FMA, F16C
    python3.11 -m venv /work/peers/llama-venv
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_AVX=ON \
        -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
        -DGGML_AVX512_VBMI=OFF -DGGML_BMI2=ON" /work/peers/llama-venv/bin/pip install --no-binary llama-cpp-python \
        --no-cache-dir llama-cpp-python==0.3.36
    # llama.cpp's converter: from the llama-cpp-python sdist (the peer's own version)
    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /work/peers/sdist
    tar xzf /work/peers/sdist/llama_cpp_python-0.3.36.tar.gz -C /work/peers/sdist
    python -m bench.make_family_gguf --family qwen3-4b --out /work/models/qwen3-4b-shape-q4_k_m.gguf \\
        --converter /work/peers/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py \\
        --llama-cpp-python /work/peers/llama-venv/bin/python
    python -m bench.make_family_gguf --family gemma3-1b --out /work/models/gemma3-1b-shape-q4_k_m.gguf \\
        --converter ... --llama-cpp-python ...
    # Qwen3-30B-A3B's shape, its first 2 layers, Q8_0 straight from the converter (a 2 GB file)
    python -m bench.make_family_gguf --family qwen3-30b-a3b --layers 2 --outtype q8_0 \\
        --out /work/models/qwen3-30b-a3b-2l-q8_0.gguf --converter ...
    # gpt-oss-20b's shape, its first 16 of 24 layers: experts in MXFP4 as OpenAI released them (the
    # converter keeps their blocks), the rest Q8_0 by the converter (an 8.5 GB file)
    python -m bench.make_family_gguf --family gpt-oss-20b --layers 16 --outtype q8_0 \\
        --out /work/models/gpt-oss-20b-16l-shape-mxfp4.gguf --converter ...

Steps (the intermediates, a bf16 checkpoint and a bf16 GGUF as large as the model, go in
--work-dir and are deleted unless --keep-intermediates):
1. config.json from transformers' Qwen3Config / Gemma3TextConfig with the real model's numbers;
   model.safetensors written one tensor at a time (memory stays at one chunk), normal values of
   std 0.02, norms near 1 (Gemma's norms are stored as weight - 1, as its checkpoints hold them).
   The parameter names and shapes are the transformers model's own (built on the meta device);
   gpt-oss's experts are OpenAI's MXFP4 tensors instead (random code bytes, exponents near 2^-8).
2. A tokenizer the converter accepts. Qwen3's converter reads a BPE tokenizer through
   AutoTokenizer and names its pre-tokenizer by a hash of how it splits a fixed text: a freshly
   trained BPE matches no known hash and the converter refuses it. The default model's
   tokenizer (SmolLM2's byte-level BPE, 49,152 entries) has a hash the converter knows
   ("smollm"), so it is used; the converter pads the vocabulary to the config's 151,936 with
   unused [PADn] entries, as it does for Qwen's own files (151,669 real entries). Gemma 3's
   converter reads a SentencePiece tokenizer.model: a small byte-fallback BPE is trained here
   (Gemma's ids for <pad> <eos> <bos> <unk>), and the converter pads it to 262,144 the same way.
3. `convert_hf_to_gguf.py --outtype bf16`, run by this interpreter (it needs torch,
   transformers, sentencepiece and numpy, and uses the gguf-py beside it).
4. llama.cpp's quantizer (llama_model_quantize, run by --llama-cpp-python) to --mix.
The block types each tensor got are logged at the end.
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import struct
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from bench.make_gguf import _LLAMA_FTYPES, llama_quantize

logger = logging.getLogger("bench.make_family_gguf")

_STD = 0.02
_CHUNK_ELEMENTS = 1 << 24  # values generated at a time: 64 MiB of float32


def qwen3_4b_config(**overrides: object) -> object:
    """Qwen3-4B's shape; overrides (smaller sizes) are for tests."""
    from transformers import Qwen3Config

    options = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                   num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                   rms_norm_eps=1e-6, tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                                "rope_theta": 1e6},
                   bos_token_id=1, eos_token_id=2, architectures=["Qwen3ForCausalLM"])
    return Qwen3Config(**options | overrides)


def gemma3_1b_config(**overrides: object) -> object:
    """Gemma-3-1B's shape (5 sliding-window layers to 1 global); overrides are for tests."""
    from transformers import Gemma3TextConfig

    options = dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
                   rms_norm_eps=1e-6, tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=512,
                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                   pad_token_id=0, eos_token_id=1, bos_token_id=2, architectures=["Gemma3ForCausalLM"]) | overrides
    options["layer_types"] = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                              for i in range(options["num_hidden_layers"])]
    return Gemma3TextConfig(**options)


def qwen3_30b_a3b_config(**overrides: object) -> object:
    """Qwen3-30B-A3B's shape (48 layers of 128 experts, 8 a token, renormalised; untied LM head);
    overrides (fewer layers: --layers) are for smaller files and tests."""
    from transformers import Qwen3MoeConfig

    options = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                   num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                   num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                   max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
                   rope_parameters={"rope_type": "default", "rope_theta": 1e6}, bos_token_id=1, eos_token_id=2,
                   architectures=["Qwen3MoeForCausalLM"])
    return Qwen3MoeConfig(**options | overrides)


def gpt_oss_20b_config(**overrides: object) -> object:
    """gpt-oss-20b's shape (24 layers of 32 experts, 4 a token, 128-token windows alternating with
    full layers, YaRN, attention sinks; untied LM head), its experts in MXFP4 as OpenAI released it
    (quantization_config mxfp4: the converter keeps such blocks as GGUF MXFP4); overrides (fewer
    layers: --layers) are for smaller files and tests."""
    from transformers import GptOssConfig

    options = dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                   num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                   num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
                   tie_word_embeddings=False, rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                               "beta_slow": 1.0, "truncate": False,
                                                               "original_max_position_embeddings": 4096,
                                                               "rope_theta": 150000.0},
                   bos_token_id=1, eos_token_id=2, architectures=["GptOssForCausalLM"]) | overrides
    options["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                              for i in range(options["num_hidden_layers"])]
    config = GptOssConfig(**options)
    config.quantization_config = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}
    return config


# family -> (config, the norms hold weight - 1, tokenizer writer name)
FAMILIES: dict[str, tuple[Callable[..., object], bool, str]] = {
    "qwen3-4b": (qwen3_4b_config, False, "bpe"),
    "qwen3-30b-a3b": (qwen3_30b_a3b_config, False, "bpe"),
    "gemma3-1b": (gemma3_1b_config, True, "sentencepiece"),
    "gpt-oss-20b": (gpt_oss_20b_config, False, "bpe"),
}
# E8M0 exponents of the random MXFP4 blocks: 2^(e - 127) times E2M1 values up to 6, about the
# bf16 tensors' spread (|w| up to 0.01-0.05)
_MXFP4_EXPONENTS = (118, 121)


def parameter_shapes(config: object) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensors: the transformers model's parameters, built on the meta device (no
    memory); a tied LM head is the embedding and is not stored, as in the real checkpoints."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if getattr(config, "quantization_config", {}).get("quant_method") == "mxfp4":
        shapes = _mxfp4_experts(shapes)
    return shapes


def _mxfp4_experts(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The experts' weights as OpenAI's MXFP4 checkpoint holds them: transformers' [E, in, out]
    gate_up_proj / down_proj as a row per output, [E, out, in / 32, 16] code bytes (`_blocks`,
    two E2M1 codes a byte) and [E, out, in / 32] exponents (`_scales`), blocks before scales (the
    converter pairs them in that order)."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            experts, inputs, outputs = shape
            out[f"{name}_blocks"] = (experts, outputs, inputs // 32, 16)
            out[f"{name}_scales"] = (experts, outputs, inputs // 32)
        else:
            out[name] = shape
    return out


def _random_chunks(shape: tuple[int, ...], is_norm: bool, norm_offset: bool,
                   generator: torch.Generator) -> list[torch.Tensor]:
    """Row chunks of one tensor's bf16 values: normal(0, 0.02), a norm around 1 (or its offset
    from 1 where the model adds 1)."""
    rows = shape[0]
    per_row = max(1, int(torch.tensor(shape[1:]).prod().item()) if len(shape) > 1 else 1)
    step = max(1, _CHUNK_ELEMENTS // per_row)
    chunks = []
    for start in range(0, rows, step):
        values = torch.randn((min(step, rows - start), *shape[1:]), generator=generator) * _STD
        if is_norm and not norm_offset:
            values += 1.0
        chunks.append(values.to(torch.bfloat16))
    return chunks


def _is_mxfp4(name: str) -> bool:
    return name.endswith(("_blocks", "_scales"))


def _random_bytes(name: str, shape: tuple[int, ...], generator: torch.Generator) -> list[torch.Tensor]:
    """Row chunks of an MXFP4 tensor's uint8: any code byte, or an exponent of _MXFP4_EXPONENTS."""
    rows, per_row = shape[0], max(1, int(torch.tensor(shape[1:]).prod().item()))
    step = max(1, _CHUNK_ELEMENTS // per_row)
    low, high = (0, 256) if name.endswith("_blocks") else _MXFP4_EXPONENTS
    return [torch.randint(low, high, (min(step, rows - start), *shape[1:]), generator=generator, dtype=torch.uint8)
            for start in range(0, rows, step)]


def write_random_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], norm_offset: bool, seed: int) -> None:
    """model.safetensors of bf16 random values (uint8 for MXFP4 blocks and exponents), streamed
    tensor by tensor (safetensors' own writer would hold the whole model in memory): an 8-byte
    header length, the JSON header, the data."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        size = (1 if _is_mxfp4(name) else 2) * int(torch.tensor(shape).prod().item())
        header[name] = {"dtype": "U8" if _is_mxfp4(name) else "BF16", "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-aligned
    generator = torch.Generator().manual_seed(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name, shape in shapes.items():
            if _is_mxfp4(name):
                for chunk in _random_bytes(name, shape, generator):
                    f.write(chunk.numpy().tobytes())
                continue
            for chunk in _random_chunks(shape, name.endswith("norm.weight"), norm_offset, generator):
                f.write(chunk.view(torch.int16).numpy().tobytes())
    logger.info("wrote %s (%.2f GB)", path, offset / 1e9)


def write_bpe_tokenizer(model_dir: Path) -> None:
    """The default model's byte-level BPE: the converter knows its pre-tokenizer's hash."""
    from engine.execution.weights.checkpoint import resolve_model

    source = resolve_model(None)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, model_dir / name)


_CORPUS = [
    "A serving engine batches many requests; the scheduler balances prefill and decode steps.",
    "Paged attention keeps keys and values in fixed-size blocks, so memory is shared and reused.",
    "def generate(prompt, max_tokens=128):\n    return engine.run(prompt, max_tokens)",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 256 1024 3.14 -7; punctuation: ()[]{}<>!?.,;:'\"",
    "Unicode text: cafe, naive, ni hao, emoji and accents in many languages.",
    "The quick brown fox jumps over the lazy dog while the model writes one token at a time.",
]


def write_sentencepiece_tokenizer(model_dir: Path) -> None:
    """A small byte-fallback SentencePiece BPE with Gemma's special ids, no normalization and no
    dummy prefix (as Gemma 3's tokenizer has), written as tokenizer.model."""
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_CORPUS * 50), model_writer=model, model_type="bpe", vocab_size=600,
        hard_vocab_limit=False, byte_fallback=True, character_coverage=1.0, split_digits=True,
        normalization_rule_name="identity", add_dummy_prefix=False, remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], num_threads=1, minloglevel=2)
    (model_dir / "tokenizer.model").write_bytes(model.getvalue())
    (model_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
         "add_bos_token": True, "add_eos_token": False}, indent=2))


def write_checkpoint(family: str, model_dir: Path, seed: int, **overrides: object) -> None:
    """model_dir: config.json, the tokenizer and model.safetensors of family's shape (overrides:
    config fields, for tests)."""
    make_config, norm_offset, tokenizer = FAMILIES[family]
    config = make_config(**overrides)
    model_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(model_dir))
    (write_bpe_tokenizer if tokenizer == "bpe" else write_sentencepiece_tokenizer)(model_dir)
    write_random_safetensors(model_dir / "model.safetensors", parameter_shapes(config), norm_offset, seed)


def convert(converter: Path, model_dir: Path, out: Path, outtype: str = "bf16") -> None:
    """llama.cpp's convert_hf_to_gguf.py, unmodified, to a GGUF of outtype (bf16, or q8_0 straight)."""
    result = subprocess.run([sys.executable, str(converter), str(model_dir), "--outtype", outtype,
                             "--outfile", str(out)], check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{converter} {model_dir} failed with code {result.returncode}")


def tensor_types(path: Path) -> dict[str, str]:
    """Each tensor's block type in a GGUF file."""
    from gguf import GGMLQuantizationType, GGUFReader

    return {t.name: GGMLQuantizationType(t.tensor_type).name for t in GGUFReader(str(path)).tensors}


def describe_types(types: dict[str, str]) -> str:
    """'Q4_K: attn_q, attn_k, ... (180 tensors); Q6_K: ...': which tensor kinds took which type."""
    kinds: dict[str, Counter] = {}
    for name, kind in types.items():
        part = name.removeprefix("blk.").split(".", 1)[-1] if name.startswith("blk.") else name
        kinds.setdefault(kind, Counter())[part.removesuffix(".weight")] += 1
    return "; ".join(f"{kind}: " + ", ".join(f"{part} x{n}" for part, n in sorted(parts.items()))
                     for kind, parts in sorted(kinds.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", required=True, choices=sorted(FAMILIES))
    parser.add_argument("--out", required=True, help="the quantized .gguf file to write")
    parser.add_argument("--converter", required=True, help="llama.cpp's convert_hf_to_gguf.py")
    parser.add_argument("--llama-cpp-python", default=None,
                        help="the interpreter of a venv with llama-cpp-python (its quantizer makes --mix)")
    parser.add_argument("--mix", default="Q4_K_M", choices=sorted(_LLAMA_FTYPES), help="llama.cpp's quantization mix")
    parser.add_argument("--outtype", default=None, choices=("q8_0", "bf16", "f16"),
                        help="the converter's own output type, written straight to --out (no quantizer, no --mix)")
    parser.add_argument("--layers", type=int, default=None, help="the first N layers only (a smaller file)")
    parser.add_argument("--work-dir", default=None, help="where the intermediates go (default: beside --out)")
    parser.add_argument("--keep-intermediates", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if (args.outtype is None) == (args.llama_cpp_python is None):
        parser.error("give --llama-cpp-python (a --mix) or --outtype (the converter's type), not both")
    if args.layers is not None and args.layers < 1:
        parser.error("--layers: a count of 1 or more")
    overrides = {} if args.layers is None else {"num_hidden_layers": args.layers}
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(args.out)
    work = Path(args.work_dir) if args.work_dir else out.parent
    model_dir, bf16 = work / f"{args.family}-shape-hf", work / f"{args.family}-shape-bf16.gguf"
    try:
        write_checkpoint(args.family, model_dir, args.seed, **overrides)
        if args.outtype is not None:
            convert(Path(args.converter), model_dir, out, args.outtype)
        else:
            convert(Path(args.converter), model_dir, bf16)
            if not args.keep_intermediates:
                shutil.rmtree(model_dir)
            llama_quantize(args.llama_cpp_python, str(bf16), str(out), args.mix)
    finally:
        if not args.keep_intermediates:
            shutil.rmtree(model_dir, ignore_errors=True)
            bf16.unlink(missing_ok=True)
    logger.info("wrote %s (%.2f GB): %s", out, out.stat().st_size / 1e9, describe_types(tensor_types(out)))


if __name__ == "__main__":
    main()
