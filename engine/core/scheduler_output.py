"""What one engine step will run: a plain value that names requests by id, logged and tested,
and never edited after `Scheduler.schedule` returns it.

The runner keeps a row per request (engine/execution/input_batch.py) and updates it from this
value's diffs: rows added (`new_requests`: admitted, resumed after preemption, or forked),
block tables changed (`block_table_updates`), rows removed (`removed_req_ids`). Then it runs
the prefill chunks and the decodes, in that order, and samples every request in
`sampling_req_ids`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine.processing.pooling_params import PoolingParams
from engine.processing.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A row the runner adds: all it needs to run and sample the request from now on."""

    req_id: str
    prompt_token_ids: list[int]  # shared with the scheduler's sequence: read only
    output_token_ids: list[int]  # a copy: tokens generated before a preemption (recompute)
    block_ids: list[list[int]]  # a block table per KV-cache group
    params: SamplingParams
    generator: torch.Generator | None
    matcher: Any  # the grammar state, shared with the scheduler's sequence (it advances it)
    min_tokens_stop_ids: frozenset[int]
    pooling_params: PoolingParams | None = None  # an embedding or score request (resolved): pooled, never sampled
    token_type_ids: np.ndarray | None = None  # [num_prompt_tokens] int64: each prompt token's segment


@dataclass(slots=True)
class SchedulerOutput:
    """Prefill chunks and decodes of one step, by request id.

    Chunk i of prefill_req_ids computes prefill_num_tokens[i] tokens starting at position
    prefill_num_computed[i]; it samples only if that chunk reaches the end of its tokens
    (prefill_is_last_chunk[i]) and is not a pooling request's (prefill_is_pooling[i]: its last
    chunk is pooled instead, and the request ends there). Every decode samples. A fork samples from its parent's logits
    row (the parent's last prefill chunk in this step) without computing anything.
    """

    new_requests: list[NewRequestData] = field(default_factory=list)
    # id -> (start, every group's table[start:])
    block_table_updates: dict[str, tuple[int, list[list[int]]]] = field(default_factory=dict)
    removed_req_ids: list[str] = field(default_factory=list)  # finished or preempted since the last step
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (source, copy): before the forward
    prefill_req_ids: list[str] = field(default_factory=list)
    prefill_num_tokens: list[int] = field(default_factory=list)
    prefill_num_computed: list[int] = field(default_factory=list)
    prefill_is_last_chunk: list[bool] = field(default_factory=list)  # the chunk ends the prompt: it samples
    # The chunk belongs to a pooling request: it never samples; its last chunk returns the pooled vector.
    prefill_is_pooling: list[bool] = field(default_factory=list)
    decode_req_ids: list[str] = field(default_factory=list)
    # Decodes that verify proposed tokens: request i computes its last token and its drafts
    # (1 + len(verify_draft_ids[i]) tokens from position num_tokens - 1) and samples at each.
    verify_req_ids: list[str] = field(default_factory=list)
    verify_draft_ids: list[list[int]] = field(default_factory=list)
    fork_req_ids: list[str] = field(default_factory=list)
    fork_parent_ids: list[str] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
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
        return len(self.decode_req_ids)

    @property
    def num_verify_tokens(self) -> int:
        """Tokens of the verifying decodes: each one's last token and its drafts."""
        return len(self.verify_req_ids) + sum(len(d) for d in self.verify_draft_ids)

    @property
    def num_batched_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_verify_tokens + self.num_decode_tokens

    @property
    def prefill_sample_rows(self) -> list[int]:
        """Indices into prefill_req_ids of the chunks that sample a token."""
        return [i for i, (is_last, is_pooling) in enumerate(zip(self.prefill_is_last_chunk, self.prefill_is_pooling,
                                                                   strict=True)) if is_last and not is_pooling]

    @property
    def sampling_req_ids(self) -> list[str]:
        """The requests that get tokens this step, in the order the runner returns them (prefill
        chunks that end their prompt, verifying decodes, decodes, then forks)."""
        return ([self.prefill_req_ids[i] for i in self.prefill_sample_rows] + self.verify_req_ids
                + self.decode_req_ids + self.fork_req_ids)

    @property
    def scheduled_req_ids(self) -> list[str]:
        """Every request this step runs or samples."""
        return self.prefill_req_ids + self.verify_req_ids + self.decode_req_ids + self.fork_req_ids

    @property
    def is_empty(self) -> bool:
        return not self.prefill_req_ids and not self.decode_req_ids and not self.verify_req_ids

    def describe(self) -> str:
        chunks = ", ".join(f"{r}:{n}" for r, n in zip(self.prefill_req_ids, self.prefill_num_tokens, strict=True))
        timing = ""
        if self.predicted_step_time is not None:
            target = f" target {1e3 * self.step_time_target:.1f} ms" if self.step_time_target is not None else ""
            timing = f" predicted {1e3 * self.predicted_step_time:.1f} ms{target}"
        forks = f" forked[{', '.join(self.fork_req_ids)}]" if self.fork_req_ids else ""
        if self.verify_req_ids:
            forks += f" verify[{', '.join(f'{r}:{len(d)}' for r, d in zip(self.verify_req_ids, self.verify_draft_ids, strict=True))}]"
        return (f"prefill[{chunks}] decode[{len(self.decode_req_ids)}]{forks} "
                f"preempted[{', '.join(self.preempted_req_ids)}] budget from {self.budget_source}{timing}")
