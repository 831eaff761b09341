"""Mistral: the Llama decoder with sliding-window attention on every layer when
`sliding_window` is set (a query sees itself and the window - 1 tokens before it)."""
from __future__ import annotations

from typing import Any

from engine.execution.models.llama import LlamaForCausalLM
from engine.execution.models.model_config import ModelConfig


class MistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def config_from_hf(cls, hf: Any) -> ModelConfig:
        return ModelConfig.from_hf(hf, qkv_bias=False, o_proj_bias=False)
