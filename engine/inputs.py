"""The admission value: a request validated and tokenized, ready for the engine thread.

LLMEngine.check_request (cheap: limits, ids, priority) and LLMEngine.process_inputs
(tokenizing, chat templates, grammar compilation: any thread but the engine's) make one; the
engine thread only admits it (LLMEngine.admit: id in use, queue full). Nothing is checked or
tokenized twice.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.processing.pooling_params import PoolingParams
from engine.processing.sampling_params import SamplingParams


@dataclass(slots=True)
class EngineRequest:
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams  # PoolingParams (resolved): an embedding request, prefill only
    request_id: str | None = None  # None: the engine names it (req-N)
    priority: int = 0  # lower runs first
    arrival_time: float | None = None  # time.monotonic(); None: when admitted
    # Each prompt token's segment (a cross-encoder's pair), for a model that reads token types
    # (None otherwise, or when the request has none).
    token_type_ids: list[int] | None = None
