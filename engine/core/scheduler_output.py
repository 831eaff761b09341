"""What one engine step will run: a plain value that can be logged and tested."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.sequence import Sequence


@dataclass(slots=True)
class SchedulerOutput:
    """Prefill chunks and decodes of one step.

    prefill_seqs[i] computes prefill_num_tokens[i] tokens starting at its
    num_computed_tokens; it samples only if that chunk reaches the end of its tokens
    (prefill_is_last_chunk[i]). Every decode samples.
    """

    prefill_seqs: list[Sequence] = field(default_factory=list)
    prefill_num_tokens: list[int] = field(default_factory=list)
    prefill_is_last_chunk: list[bool] = field(default_factory=list)  # the chunk ends the prompt: it samples
    decode_seqs: list[Sequence] = field(default_factory=list)
    preempted_seqs: list[Sequence] = field(default_factory=list)
    # Samples forked this step from a request's sample 0 (after the forward): each samples from
    # its parent's logits row, fork_rows[i] of the stacked rows.
    forked_seqs: list[Sequence] = field(default_factory=list)
    fork_rows: list[int] = field(default_factory=list)
    num_prefix_queried_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    # Why the prefill got what it got: "tokens" (the token budget) or "time" (the step-time target).
    budget_source: str = "tokens"
    step_time_target: float | None = None  # seconds, when the time budget applied
    predicted_step_time: float | None = None  # seconds, by the learned cost model
    # The cost model's view of the step (decode seqs, decode context, prefill tokens, attention
    # pairs, cached tokens the prefill chunks read).
    cost_features: tuple[int, int, int, float, int] = (0, 0, 0, 0.0, 0)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.prefill_num_tokens)

    @property
    def num_decode_tokens(self) -> int:
        return len(self.decode_seqs)

    @property
    def num_batched_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def prefill_sample_rows(self) -> list[int]:
        """Indices into prefill_seqs of the chunks that sample a token."""
        return [i for i, is_last in enumerate(self.prefill_is_last_chunk) if is_last]

    @property
    def sampling_seqs(self) -> list[Sequence]:
        """The sequences that get a token this step, in the order the logits are stacked
        (forked samples last, sampling from copies of their parents' rows)."""
        return [self.prefill_seqs[i] for i in self.prefill_sample_rows] + self.decode_seqs + self.forked_seqs

    @property
    def is_empty(self) -> bool:
        return not self.prefill_seqs and not self.decode_seqs

    def describe(self) -> str:
        chunks = ", ".join(f"{s.request_id}:{n}" for s, n in zip(self.prefill_seqs, self.prefill_num_tokens, strict=True))
        timing = ""
        if self.predicted_step_time is not None:
            target = f" target {1e3 * self.step_time_target:.1f} ms" if self.step_time_target is not None else ""
            timing = f" predicted {1e3 * self.predicted_step_time:.1f} ms{target}"
        return (f"prefill[{chunks}] decode[{len(self.decode_seqs)}] "
                f"preempted[{', '.join(s.request_id for s in self.preempted_seqs)}] "
                f"budget from {self.budget_source}{timing}")
