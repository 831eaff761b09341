"""What one forward returns to the scheduler: a plain value, applied in one place
(`Scheduler.update_from_output`)."""
from __future__ import annotations

from dataclasses import dataclass, field

Logprobs = dict[int, float]


@dataclass(slots=True)
class RunnerOutput:
    """The step's tokens per request, in `SchedulerOutput.sampling_req_ids` order: one each, or
    for a verifying decode its accepted drafts and the token sampled after them."""

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[Logprobs] | None] = field(default_factory=list)  # per token: its logprob + top-N, when asked
    # Proposals for the next step, by request (speculative decoding): the scheduler decides
    # whether they are verified.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # (request, first prompt position, entries) of the chunks that asked for prompt logprobs:
    # entry k scores prompt token first + k.
    prompt_logprobs: list[tuple[str, int, list[Logprobs]]] = field(default_factory=list)
    # The pooling requests whose prompt ended this step (in prefill order) and their outputs: an
    # embed request's vector (pooled, truncated to its dimensions and normalised as it asked), a
    # score request's score-head logits [num_labels].
    pooled_req_ids: list[str] = field(default_factory=list)
    pooled: list[list[float]] = field(default_factory=list)
    prepare_time: float = 0.0  # seconds of host-side input building
    forward_time: float = 0.0  # seconds of the model forward and the logits
    sample_time: float = 0.0  # seconds of sampling
    num_experts_touched: int = 0  # distinct experts the step ran, summed over the MoE layers (0: dense)
