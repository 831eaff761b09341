"""Qwen2 / Qwen2.5: the Llama decoder with a bias on q/k/v (not on o), tied or untied
embeddings, and sliding-window attention on the layers `layer_types` names."""
from __future__ import annotations

from typing import Any

from engine.execution.models.llama import LlamaForCausalLM
from engine.execution.models.model_config import ModelConfig


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def config_from_hf(cls, hf: Any) -> ModelConfig:
        return ModelConfig.from_hf(hf, qkv_bias=True, o_proj_bias=False)
