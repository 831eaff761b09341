"""One request's scheduling state as it moves WAITING -> RUNNING -> FINISHED (and back on preemption).

What a token means for the client (text, logprobs, stop strings) is the output processor's
(engine/processing/output_processor.py); this is what the scheduler needs to decide steps.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine.outputs import FinishReason
from engine.processing.pooling_params import PoolingParams, PoolingType
from engine.processing.request_tokens import RequestTokens
from engine.processing.sampling_params import SamplingParams

PLACEHOLDER = -1  # an output token a scheduled step will sample (async scheduling)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    FORK_PENDING = "fork_pending"  # a sample of an n > 1 request, waiting for sample 0's prompt


@dataclass(slots=True)
class SequenceTimes:
    """Wall-clock stamps (time.monotonic seconds) that metrics and traces derive from."""

    arrival: float
    first_scheduled: float | None = None
    finished: float | None = None


@dataclass(slots=True, eq=False)
class Sequence(RequestTokens):
    """A request inside the scheduler.

    Tokens [0, num_computed_tokens) have K/V in the cache at slots given by block_tables (one
    table per KV-cache group, engine/execution/kv_cache_layout.py; block_table is the first);
    the rest still have to run through the model. A decode is the case of exactly one
    uncomputed token after at least one generated token.

    Owners: the Scheduler moves status, num_computed_tokens and output_token_ids; the
    BlockManager owns block_tables, block_hashes, num_registered_blocks and
    block_table_changed_from.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0  # lower runs first; waiting lowers it further (aging)
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0
    block_tables: list[list[int]] = field(default_factory=lambda: [[]])
    block_hashes: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0  # full blocks already published to the prefix cache
    # The first block table entry, in any group's table, the runner has not seen yet (appended,
    # replaced by a copy-on-write, or released by a window group); None: the runner's copy is current.
    block_table_changed_from: int | None = 0
    is_in_runner: bool = False  # the runner holds a row for it (added, not yet removed)
    num_cached_prompt_tokens: int = 0  # prefix-cache hits at first admission
    num_preemptions: int = 0
    last_scheduled_step: int = -1
    generator: torch.Generator | None = None
    matcher: Any = None  # the grammar state of a structured-output request (llguidance LLMatcher)
    # Parallel sampling (params.n > 1): the request's id, which outputs carry, and this sample's
    # index. Sample 0 is the request itself (group_id == request_id); it prefills the prompt
    # once and the others fork from it when the chunk that ends its prompt is scheduled.
    group_id: str = ""
    index: int = 0
    # Speculative decoding: the runner's proposals for the next step, and how verification went.
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0  # proposed and verified, over the request
    num_accepted_tokens: int = 0
    # An embedding or score request (resolved): prefill only, pooled by the runner as its prompt ends.
    pooling_params: PoolingParams | None = None
    # Each prompt token's segment (a BERT cross-encoder's pair: 0 the query's, 1 the document's),
    # [num_prompt_tokens] int64; only for a model that reads token types.
    token_type_ids: np.ndarray | None = None
    # Async scheduling: output_token_ids ends with this many PLACEHOLDERs, the tokens of steps
    # scheduled and not yet processed (at most one when a step is scheduled, two just after).
    num_placeholders: int = 0
    # Async scheduling: of num_computed_tokens, those whose step has not been processed yet (its
    # K/V may not be written: a failed step never writes it), kept out of the prefix cache.
    num_inflight_tokens: int = 0
    times: SequenceTimes = field(init=False)
    # Token ids min_tokens holds off (stop ids, and EOS unless ignored): built once, used per step.
    min_tokens_stop_ids: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        self.group_id = self.group_id or self.request_id
        self.times = SequenceTimes(arrival=self.arrival_time)
        eos = frozenset() if self.params.ignore_eos else self.eos_token_ids
        self.min_tokens_stop_ids = self.params.stop_token_set | eos

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def needs_fork(self) -> bool:
        """Sample 0 of an n > 1 request before its first token: the others fork from it."""
        return self.params.n > 1 and self.index == 0 and self.num_output_tokens == 0

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    @property
    def needs_every_prompt_position(self) -> bool:
        """Prompt logprobs, and mean or CLS pooling, read every prompt position's hidden state:
        a cached prefix would skip them. A prompt with token types computes every position too: the
        prefix cache is keyed by token ids alone."""
        if self.token_type_ids is not None:
            return True
        if self.pooling_params is not None:
            return self.pooling_params.pooling_type is not PoolingType.LAST
        return self.params.prompt_logprobs is not None

    @property
    def is_decode(self) -> bool:
        return self.num_output_tokens > 0 and self.num_uncomputed_tokens == 1

    def will_reach_a_limit(self, max_model_len: int) -> bool:
        """Its tokens, the scheduled ones counted, reach max_tokens or the context: the step that
        samples the last of them ends it, so no later step may run it (async scheduling: in a
        synchronous loop such a request has ended already)."""
        max_tokens = self.params.max_tokens
        return (max_tokens is not None and self.num_output_tokens >= max_tokens) or self.num_tokens >= max_model_len

    def add_placeholder(self) -> None:
        self.output_token_ids.append(PLACEHOLDER)
        self.num_placeholders += 1

    def fill_placeholder(self, token_id: int) -> None:
        """The oldest scheduled step's token, in its place."""
        self.output_token_ids[len(self.output_token_ids) - self.num_placeholders] = token_id
        self.num_placeholders -= 1

    def drop_placeholders(self) -> None:
        """An ended request's outputs: what was sampled, not what a step in flight would add."""
        if self.num_placeholders:
            del self.output_token_ids[-self.num_placeholders:]
            self.num_placeholders = 0

    def check_stop(self, token_id: int, max_model_len: int) -> tuple[FinishReason | None, int | None]:
        """The stop conditions its newest token (token_id, already appended) decides alone:
        a complete grammar, EOS, a stop token id (after min_tokens), max_tokens, the context.
        Stop strings need the text: the output processor checks those. Placeholders after it
        (steps in flight) do not count."""
        params = self.params
        num_output = self.num_output_tokens - self.num_placeholders
        if self.matcher is not None and self.matcher.is_stopped():  # the grammar is complete: nothing may follow
            return FinishReason.STOP, None
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return FinishReason.STOP, None
            if token_id in params.stop_token_set:
                return FinishReason.STOP, token_id
        if (params.max_tokens is not None and num_output >= params.max_tokens) \
                or self.num_tokens - self.num_placeholders >= max_model_len:
            return FinishReason.LENGTH, None
        return None, None
