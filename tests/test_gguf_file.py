"""GGUFFile on tiny GGUF files written here by the `gguf` package: every tensor's blocks come back
as written (the types with kernels), dequantized once with a warning naming the type (the others);
llama query / key rows in Hugging Face's order; shapes checked against the metadata; a truncated
file and an unsupported architecture refused with messages that say so."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from bench.random_blocks import random_blocks
from engine.execution.weights.gguf_file import GGUFFile
from engine.execution.weights.quantized_weight import QuantizedWeight
from tests.gguf_samples import write_gguf

T = GGMLQuantizationType
HIDDEN, HEADS, KV_HEADS, FF, VOCAB = 256, 4, 2, 512, 40
HEAD_DIM = HIDDEN // HEADS
METADATA = {"block_count": 1, "embedding_length": HIDDEN, "attention.head_count": HEADS,
            "attention.head_count_kv": KV_HEADS, "feed_forward_length": FF, "vocab_size": VOCAB}


def _tensors(rng: np.random.Generator) -> dict[str, tuple[np.ndarray, T]]:
    q5 = quantize(rng.standard_normal((FF, HIDDEN)).astype(np.float32), T.Q5_0)  # a type without kernels
    return {
        "token_embd.weight": (random_blocks(T.Q8_0, VOCAB, HIDDEN, rng), T.Q8_0),
        "blk.0.attn_norm.weight": (rng.standard_normal(HIDDEN).astype(np.float32), T.F32),
        "blk.0.attn_q.weight": (random_blocks(T.Q4_0, HEADS * HEAD_DIM, HIDDEN, rng), T.Q4_0),
        "blk.0.attn_k.weight": (random_blocks(T.Q4_1, KV_HEADS * HEAD_DIM, HIDDEN, rng), T.Q4_1),
        "blk.0.attn_v.weight": (random_blocks(T.Q6_K, KV_HEADS * HEAD_DIM, HIDDEN, rng), T.Q6_K),
        "blk.0.attn_output.weight": (random_blocks(T.Q4_K, HIDDEN, HEADS * HEAD_DIM, rng), T.Q4_K),
        "blk.0.ffn_gate.weight": (q5, T.Q5_0),
        "blk.0.ffn_up.weight": (rng.standard_normal((FF, HIDDEN)).astype(np.float16), T.F16),
        "blk.0.ffn_down.weight": (random_blocks(T.Q6_K, HIDDEN, FF, rng), T.Q6_K),
        "blk.0.ffn_norm.weight": (rng.standard_normal(HIDDEN).astype(np.float32), T.F32),
        "output_norm.weight": (rng.standard_normal(HIDDEN).astype(np.float32), T.F32),
    }


def _hf_order(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp stores head h's rotary pairs interleaved: its row h * D + 2i + j is Hugging
    Face's row h * D + j * D / 2 + i."""
    out = np.empty_like(rows)
    for h in range(num_heads):
        for i in range(HEAD_DIM // 2):
            for j in range(2):
                out[h * HEAD_DIM + j * HEAD_DIM // 2 + i] = rows[h * HEAD_DIM + 2 * i + j]
    return out


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_tensors_come_back_as_their_blocks(tmp_path: Path, architecture: str, caplog) -> None:
    written = _tensors(np.random.default_rng(0))
    path = write_gguf(tmp_path / "m.gguf", architecture, METADATA, written)
    with caplog.at_level(logging.WARNING, logger="engine.execution.weights.gguf_file"):
        tensors = {t.name: t for t in GGUFFile(path).tensors()}
    assert list(tensors) == list(written)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "type Q5_0" in warnings[0] and "blk.0.ffn_gate.weight" in warnings[0]
    for name, (data, quant_type) in written.items():
        t = tensors[name]
        if quant_type == T.Q5_0:  # dequantized once, as the gguf package does
            assert t.quant_type == T.F32 and not t.is_blocks and t.shape == (FF, HIDDEN)
            assert np.array_equal(t.data, dequantize(data, T.Q5_0).reshape(FF, HIDDEN))
            continue
        assert t.quant_type == quant_type and t.is_blocks == (quant_type not in (T.F32, T.F16))
        expected = data
        if architecture == "llama" and (".attn_q." in name or ".attn_k." in name):
            expected = _hf_order(data, HEADS if ".attn_q." in name else KV_HEADS)
        assert np.array_equal(t.data, expected), name
    assert tensors["blk.0.attn_output.weight"].shape == (HIDDEN, HEADS * HEAD_DIM)
    q = tensors["blk.0.attn_q.weight"]
    assert q.shape == (HEADS * HEAD_DIM, HIDDEN) and q.data.shape == (HEADS * HEAD_DIM, HIDDEN // 32 * 18)
    weight = QuantizedWeight.pack(q.data, q.quant_type, q.shape[1])
    assert weight.dequantize().shape == q.shape


def test_truncated_file_is_refused_naming_the_truncation(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", "llama", METADATA, _tensors(np.random.default_rng(1)))
    data = path.read_bytes()
    for cut in (40, 2000, len(data) // 2, len(data) - 1):
        short = tmp_path / f"cut{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=rf"cut{cut}.gguf' is truncated: it has {cut} bytes"):
            GGUFFile(short)
    (tmp_path / "text.gguf").write_text("not a GGUF file at all, but long enough to hold a header")
    with pytest.raises(ValueError, match="is not a readable GGUF file"):
        GGUFFile(tmp_path / "text.gguf")


def test_unsupported_architecture_is_refused_naming_it(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", "gpt2", METADATA, {})
    with pytest.raises(ValueError, match=r"GGUF architecture 'gpt2' of m.gguf is not supported; supported: llama"):
        GGUFFile(path)


def test_shapes_are_checked_against_the_metadata(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    tensors = _tensors(rng)
    tensors["blk.0.attn_k.weight"] = (random_blocks(T.Q4_1, HEADS * HEAD_DIM, HIDDEN, rng), T.Q4_1)  # as many as q
    path = write_gguf(tmp_path / "m.gguf", "llama", METADATA, tensors)
    with pytest.raises(ValueError, match=r"blk.0.attn_k.weight has shape \[256, 256\], expected \[128, 256\]"):
        list(GGUFFile(path).tensors())
    tensors = _tensors(rng)
    tensors["blk.1.ffn_norm.weight"] = tensors["blk.0.ffn_norm.weight"]
    path = write_gguf(tmp_path / "m2.gguf", "llama", METADATA, tensors)
    with pytest.raises(ValueError, match="blk.1.ffn_norm.weight is past the file's 1 layers"):
        list(GGUFFile(path).tensors())


_HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


@pytest.mark.real_model
def test_the_shipped_q4_1_file_reads_as_transformers_dequantizes_it() -> None:
    """Every tensor of the default model's GGUF (Q4_1 layers, a Q8_0 embedding, float32 norms),
    packed and dequantized, equals transformers' float32 conversion of the same file, the query
    and key rows in its order."""
    from safetensors import safe_open

    from engine.execution.weights.checkpoint import fetch_default_gguf, resolve_model

    converted = safe_open(str(resolve_model(None) / "model.safetensors"), framework="pt")
    file = GGUFFile(fetch_default_gguf())
    seen = set()
    for t in file.tensors():
        layer = t.name.split(".")
        if layer[0] == "blk":
            hf_name = f"model.layers.{layer[1]}.{_HF_NAMES[layer[2]]}.weight"
        else:
            hf_name = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}[t.name]
        values = QuantizedWeight.pack(t.data, t.quant_type, t.shape[1]).dequantize() if t.is_blocks else t.data
        assert np.array_equal(np.asarray(values), converted.get_tensor(hf_name).numpy()), t.name
        seen.add(t.quant_type)
    assert seen == {T.Q4_1, T.Q8_0, T.F32}


def test_every_architecture_the_reader_maps_has_a_model_family() -> None:
    """weights/ keeps its own list (it never imports models/): the two must not drift apart."""
    from engine.execution.models import SUPPORTED_MODEL_TYPES
    from engine.execution.weights.gguf_file import GGUF_ARCHITECTURES

    assert set(GGUF_ARCHITECTURES) <= set(SUPPORTED_MODEL_TYPES)
