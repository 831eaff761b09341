"""model_type (from config.json) -> the class that implements it, imported on first use."""
from __future__ import annotations

import importlib

from engine.execution.models.llama import LlamaForCausalLM

_MODELS: dict[str, tuple[str, str]] = {
    "llama": ("engine.execution.models.llama", "LlamaForCausalLM"),
    "mistral": ("engine.execution.models.mistral", "MistralForCausalLM"),
    "qwen2": ("engine.execution.models.qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("engine.execution.models.qwen3", "Qwen3ForCausalLM"),
    "qwen3_moe": ("engine.execution.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "gemma3_text": ("engine.execution.models.gemma3", "Gemma3ForCausalLM"),
    "gemma3": ("engine.execution.models.gemma3", "Gemma3ForCausalLM"),
    "gpt_oss": ("engine.execution.models.gpt_oss", "GptOssForCausalLM"),
}

SUPPORTED_MODEL_TYPES = tuple(_MODELS)


def model_class(model_type: str) -> type[LlamaForCausalLM]:
    if model_type not in _MODELS:
        raise ValueError(f"model: model_type {model_type!r} is not supported; use one of {SUPPORTED_MODEL_TYPES}")
    module, name = _MODELS[model_type]
    return getattr(importlib.import_module(module), name)
