"""Model implementations, found through the registry by config.json's model_type."""
from engine.execution.models.model_config import ModelConfig
from engine.execution.models.registry import SUPPORTED_MODEL_TYPES, model_class

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelConfig", "model_class"]
