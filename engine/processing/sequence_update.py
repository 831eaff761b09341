"""What a step did to one request, as the scheduler hands it to output processing: a plain value,
so formatting (text, stop strings, logprobs, metrics) never reads or calls the scheduler."""
from __future__ import annotations

from dataclasses import dataclass

from engine.outputs import FinishReason

Logprobs = dict[int, float]


@dataclass(slots=True)
class SequenceUpdate:
    request_id: str
    new_token_ids: list[int]  # appended this step (empty when the request only ended)
    new_logprobs: list[Logprobs] | None = None
    finish_reason: FinishReason | None = None  # decided by the tokens alone (or an abort / a fault)
    stop_reason: int | str | None = None
    error: str | None = None
    # Scheduling facts a finished request's metrics need.
    first_scheduled_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    finished_time: float | None = None
    num_draft_tokens: int = 0  # speculative decoding, over the request so far
    num_accepted_tokens: int = 0
    pooled: list[float] | None = None  # a pooling request's output (vector or score logits), as it finishes
