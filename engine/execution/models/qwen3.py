"""Qwen3 (dense): the Llama decoder with an RMSNorm over each head's query and key before RoPE,
no projection biases, and head_dim taken from the config (128 at every size, not hidden / heads)."""
from __future__ import annotations

from typing import Any

from engine.execution.models.llama import LlamaForCausalLM
from engine.execution.models.model_config import ModelConfig


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def config_from_hf(cls, hf: Any) -> ModelConfig:
        return ModelConfig.from_hf(hf, qkv_bias=bool(getattr(hf, "attention_bias", False)),
                                   o_proj_bias=bool(getattr(hf, "attention_bias", False)), qk_norm=True)
