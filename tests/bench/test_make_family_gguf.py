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


def test_the_moe_checkpoint_loads_with_its_experts_and_an_untied_head(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    config = FAMILIES["qwen3-30b-a3b"][0](**_SMALL, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
    config.save_pretrained(str(tmp_path))
    write_random_safetensors(tmp_path / "model.safetensors", parameter_shapes(config), False, seed=0)
    model, info = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (4, 64, 64) and abs(experts.gate_up_proj.std().item() - 0.02) < 0.002
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)  # untied, as Qwen3-30B-A3B's
    assert FAMILIES["qwen3-30b-a3b"][0]().num_experts == 128


def test_gemma_keeps_five_sliding_window_layers_to_one_global() -> None:
    config = FAMILIES["gemma3-1b"][0]()
    assert config.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"] and len(config.layer_types) == 26
    assert config.sliding_window == 512 and config.query_pre_attn_scalar == 256


def test_the_types_are_summed_per_tensor_kind() -> None:
    types = {"token_embd.weight": "Q6_K", "blk.0.ffn_down.weight": "Q6_K", "blk.1.ffn_down.weight": "Q4_K",
             "blk.0.attn_q.weight": "Q4_K", "blk.1.attn_q.weight": "Q4_K", "output_norm.weight": "F32"}
    assert describe_types(types) == "F32: output_norm x1; Q4_K: attn_q x2, ffn_down x1; Q6_K: ffn_down x1, token_embd x1"
