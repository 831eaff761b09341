"""minivllm engine: continuous batching with split prefill/decode paths on a paged KV cache.

Public API: `from engine import LLM, SamplingParams`.
"""
from engine.config import EngineConfig
from engine.errors import PromptTooLongError, QueueFullError
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import RequestMetrics, RequestOutput, StepStats
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM", "EngineConfig", "LLMEngine", "PromptTooLongError", "QueueFullError", "RequestMetrics",
    "RequestOutput", "SamplingParams", "StepStats",
]
