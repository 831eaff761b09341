"""bench.make_family_gguf's checkpoint: the streamed safetensors file is one transformers loads as
the family's model, every parameter present, of the values it promises. (The conversion and the
quantization are llama.cpp's own programs, run by the script, not here.)"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.make_family_gguf import FAMILIES, describe_types, parameter_shapes, write_random_safetensors

_SMALL = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


@pytest.mark.parametrize("family", ["gemma3-1b", "qwen3-4b"])
def test_the_random_checkpoint_loads_as_the_familys_model(family: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    make_config, norm_offset, _ = FAMILIES[family]
    config = make_config(**_SMALL)
    config.save_pretrained(str(tmp_path))
    write_random_safetensors(tmp_path / "model.safetensors", parameter_shapes(config), norm_offset, seed=0)
    model, info = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    layer = model.model.layers[0]
    weight = layer.mlp.gate_proj.weight
    assert weight.shape == (128, 64) and abs(weight.std().item() - 0.02) < 0.002 and abs(weight.mean().item()) < 0.002
    norm = layer.input_layernorm.weight
    assert abs(norm.mean().item() - (0.0 if norm_offset else 1.0)) < 0.01  # Gemma stores its norms as weight - 1
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)  # tied, as the real models are


def test_the_moe_checkpoint_loads_with_every_expert(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    make_config, norm_offset, _ = FAMILIES["qwen3-30b-a3b"]
    assert make_config().num_hidden_layers == 48 and make_config(num_hidden_layers=24).num_hidden_layers == 24
    config = make_config(**_SMALL, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    config.save_pretrained(str(tmp_path))
    write_random_safetensors(tmp_path / "model.safetensors", parameter_shapes(config), norm_offset, seed=0)
    model, info = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    for layer in model.model.layers:  # every layer sparse, as Qwen3-30B-A3B's
        experts = dict(layer.mlp.experts.named_parameters())
        assert sum(p.numel() for p in experts.values()) == 8 * 3 * 64 * 32
        assert all(abs(p.std().item() - 0.02) < 0.002 for p in experts.values())
        assert layer.mlp.gate.weight.shape == (8, 64)
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)  # untied, as the real model's


def test_gemma_keeps_five_sliding_window_layers_to_one_global() -> None:
    config = FAMILIES["gemma3-1b"][0]()
    assert config.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"] and len(config.layer_types) == 26
    assert config.sliding_window == 512 and config.query_pre_attn_scalar == 256


def test_the_types_are_summed_per_tensor_kind() -> None:
    types = {"token_embd.weight": "Q6_K", "blk.0.ffn_down.weight": "Q6_K", "blk.1.ffn_down.weight": "Q4_K",
             "blk.0.attn_q.weight": "Q4_K", "blk.1.attn_q.weight": "Q4_K", "output_norm.weight": "F32"}
    assert describe_types(types) == "F32: output_norm x1; Q4_K: attn_q x2, ffn_down x1; Q6_K: ffn_down x1, token_embd x1"


_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _openai_mxfp4_values(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """OpenAI's MXFP4 tensors ([..., K / 32, 16] code bytes, the even k in the low nibble; [..., K / 32]
    E8M0 exponents) -> float values [..., K]."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., K / 32, 32]
    values = _E2M1[codes] * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return values.flatten(-2)


def test_the_gpt_oss_checkpoint_converts_to_mxfp4_experts(tmp_path: Path) -> None:
    """The gpt-oss family's experts are written as OpenAI's MXFP4 checkpoint holds them, so llama.cpp's
    converter keeps them as GGUF MXFP4 blocks of the same values; the rest converts as bf16 tensors do."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import load_file

    from bench.make_family_gguf import write_bpe_tokenizer
    from tests.field_gguf import convert_hf_to_gguf

    make_config, norm_offset, _ = FAMILIES["gpt-oss-20b"]
    full = make_config()
    assert (full.num_hidden_layers, full.num_local_experts, full.num_experts_per_tok, full.hidden_size) == (24, 32, 4, 2880)
    config = make_config(**_SMALL | {"intermediate_size": 64, "vocab_size": 49152}, num_local_experts=4,
                         num_experts_per_tok=2)  # the vocabulary holds the tokenizer's
    config.save_pretrained(str(tmp_path))
    write_bpe_tokenizer(tmp_path)
    write_random_safetensors(tmp_path / "model.safetensors", parameter_shapes(config), norm_offset, seed=0)
    state = load_file(str(tmp_path / "model.safetensors"))
    blocks, scales = state["model.layers.1.mlp.experts.down_proj_blocks"], state["model.layers.1.mlp.experts.down_proj_scales"]
    assert blocks.dtype == torch.uint8 and blocks.shape == (4, 64, 2, 16) and scales.shape == (4, 64, 2)
    assert 118 <= int(scales.min()) and int(scales.max()) <= 120
    assert "model.layers.1.mlp.experts.down_proj" not in state and state["model.layers.1.mlp.experts.down_proj_bias"].shape == (4, 64)
    out = convert_hf_to_gguf(tmp_path, tmp_path / "out.gguf", "q8_0")
    tensors = {t.name: t for t in GGUFReader(str(out)).tensors}
    assert {tensors[f"blk.1.ffn_{p}_exps.weight"].tensor_type.name for p in ("gate", "up", "down")} == {"MXFP4"}
    assert tensors["blk.1.attn_q.weight"].tensor_type.name == "Q8_0"
    down = tensors["blk.1.ffn_down_exps.weight"]
    got = torch.from_numpy(dequantize(down.data, down.tensor_type).copy()).reshape(4, 64, 64)  # [E, out, in]
    assert torch.equal(got, _openai_mxfp4_values(blocks, scales))
    gate_up = _openai_mxfp4_values(state["model.layers.1.mlp.experts.gate_up_proj_blocks"],
                                   state["model.layers.1.mlp.experts.gate_up_proj_scales"])  # [E, 2I] rows: gate, up alternating
    gate = tensors["blk.1.ffn_gate_exps.weight"]
    assert torch.equal(torch.from_numpy(dequantize(gate.data, gate.tensor_type).copy()).reshape(4, 64, 64), gate_up[:, 0::2])
