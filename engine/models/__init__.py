"""Model implementations, found through the registry by config.json's model_type."""
from engine.models.model_config import ModelConfig
from engine.models.registry import SUPPORTED_MODEL_TYPES, model_class

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelConfig", "model_class"]
