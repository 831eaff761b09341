"""What one forward returns to the scheduler: a plain value, applied in one place
(`Scheduler.update_from_output`)."""
from __future__ import annotations

from dataclasses import dataclass, field

Logprobs = dict[int, float]


@dataclass(slots=True)
class RunnerOutput:
    """The step's sampled tokens, in `SchedulerOutput.sampling_req_ids` order."""

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs | None] = field(default_factory=list)  # per row: sampled token + top-N, when asked
    # (request, first prompt position, entries) of the chunks that asked for prompt logprobs:
    # entry k scores prompt token first + k.
    prompt_logprobs: list[tuple[str, int, list[Logprobs]]] = field(default_factory=list)
    prepare_time: float = 0.0  # seconds of host-side input building
    forward_time: float = 0.0  # seconds of the model forward and the logits
    sample_time: float = 0.0  # seconds of sampling
