"""model_type (from config.json), or a task head named by its architectures, -> the class that
implements it, imported on first use."""
from __future__ import annotations

import importlib

from torch import nn

_MODELS: dict[str, tuple[str, str]] = {
    "llama": ("engine.execution.models.llama", "LlamaForCausalLM"),
    "mistral": ("engine.execution.models.mistral", "MistralForCausalLM"),
    "qwen2": ("engine.execution.models.qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("engine.execution.models.qwen3", "Qwen3ForCausalLM"),
    "qwen3_moe": ("engine.execution.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "gemma3_text": ("engine.execution.models.gemma3", "Gemma3ForCausalLM"),
    "gemma3": ("engine.execution.models.gemma3", "Gemma3ForCausalLM"),
    "gpt_oss": ("engine.execution.models.gpt_oss", "GptOssForCausalLM"),
    "bert": ("engine.execution.models.bert", "BertModel"),
    "roberta": ("engine.execution.models.roberta", "RobertaModel"),
    "xlm-roberta": ("engine.execution.models.roberta", "RobertaModel"),
}
# A checkpoint whose config.architectures names one of these runs that class instead of its
# model_type's (a BERT cross-encoder: the encoder plus its classification head).
_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "BertForSequenceClassification": ("engine.execution.models.bert", "BertForSequenceClassification"),
    "RobertaForSequenceClassification": ("engine.execution.models.roberta", "RobertaForSequenceClassification"),
    "XLMRobertaForSequenceClassification": ("engine.execution.models.roberta", "RobertaForSequenceClassification"),
}

SUPPORTED_MODEL_TYPES = tuple(_MODELS)


def model_class(model_type: str, architectures: list[str] | None = None) -> type[nn.Module]:
    if model_type not in _MODELS:
        raise ValueError(f"model: model_type {model_type!r} is not supported; use one of {SUPPORTED_MODEL_TYPES}")
    module, name = next((_ARCHITECTURES[a] for a in architectures or () if a in _ARCHITECTURES), _MODELS[model_type])
    return getattr(importlib.import_module(module), name)
