"""minivllm engine: continuous batching with split prefill/decode paths on a paged KV cache.

Public API: `from engine import LLM, SamplingParams` (offline), `LLMEngine` (the step API), and
the plain values that cross to the service. Other layers import only these names.
"""
from engine.config import EngineConfig, default_cache_dir
from engine.errors import FieldError, LimitExceededError, PromptTooLongError, QueueFullError, RequestIdInUseError
from engine.execution.weights.checkpoint import model_display_name, resolve_model
from engine.inputs import EngineRequest
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvCacheEvent,
    ModelInfo,
    RequestMetrics,
    RequestOutput,
    StepStats,
)
from engine.processing.input_processor import is_encodable
from engine.processing.json_schema_check import unmatchable_schema
from engine.processing.pooling_params import PoolingParams, PoolingTask, PoolingType
from engine.processing.sampling_params import SamplingParams
from engine.processing.structured_output import StructuredOutput

__all__ = [
    "LLM", "AllBlocksCleared", "BlockRemoved", "BlockStored", "EngineConfig", "KvCacheEvent", "EngineRequest", "FieldError", "LLMEngine", "LimitExceededError", "ModelInfo", "PromptTooLongError", "QueueFullError",
    "PoolingParams", "PoolingTask", "PoolingType", "RequestIdInUseError", "RequestMetrics", "RequestOutput", "SamplingParams",
    "StepStats", "StructuredOutput", "default_cache_dir", "is_encodable",
    "model_display_name",
    "resolve_model",
    "unmatchable_schema",
]
