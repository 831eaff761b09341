"""Model implementations. All supported architectures share the Llama decoder."""
from engine.models.llama import SUPPORTED_MODEL_TYPES, LlamaForCausalLM, ModelConfig

__all__ = ["SUPPORTED_MODEL_TYPES", "LlamaForCausalLM", "ModelConfig"]
