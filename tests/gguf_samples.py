"""GGUF test material made here, no download: tiny GGUF files written with the `gguf` package (their
random blocks: bench.random_blocks)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

T = GGMLQuantizationType


def write_gguf(path: Path, architecture: str, metadata: dict[str, int],
               tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]]) -> Path:
    """A GGUF file of `architecture` with integer metadata (keys without the architecture's prefix)
    and tensors: name -> (blocks [N, row bytes] uint8 of a quantized type, or float values)."""
    writer = GGUFWriter(str(path), architecture)
    for key, value in metadata.items():
        writer.add_uint32(f"{architecture}.{key}", value)
    for name, (data, quant_type) in tensors.items():
        if quant_type in (T.F32, T.F16):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=quant_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _llama_cpp_rows(data: np.ndarray, num_heads: int) -> np.ndarray:
    """Hugging Face's query / key rows in llama.cpp's rotary order (what its converter writes)."""
    rows = data.shape[0]
    half = rows // num_heads // 2
    return np.ascontiguousarray(data.reshape(num_heads, 2, half, *data.shape[1:]).swapaxes(1, 2)).reshape(data.shape)


def write_family_gguf(hf_dir: Path, path: Path, twin_dir: Path, quant_type: GGMLQuantizationType,
                      tensor_types: dict[str, GGMLQuantizationType] | None = None) -> Path:
    """A GGUF file of the HF model in hf_dir (llama, mistral or qwen2), as llama.cpp's converter
    lays it out: its projections and embedding quantized to quant_type by the `gguf` package, norms
    and biases float32, the config and the tokenizer (byte-level BPE, chat template) as metadata.
    twin_dir gets its safetensors twin: the same weights dequantized to float32 (the exact
    reference for the file's values), with hf_dir's config and tokenizer. tensor_types: another
    type for the matrices whose GGUF names hold a key (".attn_v.": a k-quant mix's V)."""
    import json
    import shutil

    import torch
    from gguf.quants import dequantize, quantize
    from safetensors.torch import load_file, save_file

    from engine.execution.weights.gguf_loader import hf_name

    config = json.loads((hf_dir / "config.json").read_text())
    arch = config["model_type"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    to_gguf = {}
    for i in range(config["num_hidden_layers"]):
        for short in ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                      "ffn_down"):
            for kind in ("weight", "bias"):
                to_gguf[hf_name(f"blk.{i}.{short}.{kind}", arch)] = f"blk.{i}.{short}.{kind}"
    for name in ("token_embd.weight", "output_norm.weight", "output.weight"):
        to_gguf[hf_name(name, arch)] = name

    state = load_file(str(next(hf_dir.glob("*.safetensors"))))
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(config.get("rope_theta") or config.get("rope_parameters", {}).get("rope_theta")))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [""] * config["vocab_size"]
    types = [1] * config["vocab_size"]
    for token, index in vocab.items():
        tokens[index] = token
    for i, token in enumerate(tokens):
        if not token:
            tokens[i], types[i] = f"[PAD{i}]", 5
    for added in tok["added_tokens"]:
        types[added["id"]] = 3
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(json.loads((hf_dir / "tokenizer_config.json").read_text()).get("chat_template")
                             or (hf_dir / "chat_template.jinja").read_text())
    twin = {}
    for name, tensor in state.items():
        values = tensor.float().numpy()
        gguf_name = to_gguf[name]
        is_matrix = values.ndim == 2
        matrix_type = next((t for key, t in (tensor_types or {}).items() if key in gguf_name), quant_type)
        if is_matrix:
            blocks = quantize(values, matrix_type)
            values = dequantize(blocks, matrix_type).reshape(values.shape).astype(np.float32)
            stored = blocks
        else:
            stored = values
        twin[name] = torch.from_numpy(values.copy())
        if arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            stored = _llama_cpp_rows(stored, heads if ".attn_q." in gguf_name else kv_heads)
        if is_matrix:
            writer.add_tensor(gguf_name, stored, raw_dtype=matrix_type)
        else:
            writer.add_tensor(gguf_name, stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    twin_dir.mkdir(parents=True, exist_ok=True)
    for file in hf_dir.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, twin_dir / file.name)
    save_file(twin, str(twin_dir / "model.safetensors"), metadata={"format": "pt"})
    return path
