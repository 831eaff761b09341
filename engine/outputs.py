"""Plain values the engine hands out: per-request outputs and per-step stats.

These are the boundary to service/: metrics, traces and gRPC messages are built from them,
so the engine never imports an observability or transport library.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # client cancel, deadline, shutdown
    ERROR = "error"  # the engine failed while serving this request


@dataclass(slots=True)
class RequestMetrics:
    """Timings of a finished request (monotonic seconds; durations in seconds)."""

    request_id: str
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float
    num_draft_tokens: int = 0  # speculative decoding: tokens proposed and verified
    num_accepted_tokens: int = 0  # of those, accepted
    task: str = "generate"  # generate | embed | score (embed, score: a pooling request, prefill only, no output tokens)

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        if self.first_scheduled_time is None or self.first_token_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time(self) -> float | None:
        return None if self.first_token_time is None else self.finished_time - self.first_token_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float:
        return self.finished_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean gap between output tokens after the first (vLLM's TPOT)."""
        if self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass(slots=True)
class RequestOutput:
    """What one request produced: the new part of this step and everything so far.

    `text` never contains a stop string, nor text that might still become one.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    new_logprobs: list[dict[int, float]] | None = None
    logprobs: list[dict[int, float]] | None = None
    metrics: RequestMetrics | None = None
    error: str | None = None
    # On the first output only, when asked: one entry per prompt token (None for the first).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    index: int = 0  # which sample of an n > 1 request (request_id is the request's)
    samples: list[RequestOutput] | None = None  # offline LLM, n > 1: every sample's final output
    embedding: list[float] | None = None  # an embed request's vector, on its final output
    scores: list[float] | None = None  # a score request's raw logits [num_labels], on its final output

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def merged_with(self, later: RequestOutput) -> RequestOutput:
        """One output covering this one and the next of the same request (a slow reader's backlog)."""
        if later.request_id != self.request_id or later.index != self.index:
            raise ValueError("can only merge outputs of the same request and sample")
        new_logprobs = None
        if self.new_logprobs is not None or later.new_logprobs is not None:
            new_logprobs = (self.new_logprobs or []) + (later.new_logprobs or [])
        return RequestOutput(
            request_id=later.request_id, prompt_token_ids=later.prompt_token_ids, token_ids=later.token_ids,
            text=later.text, new_token_ids=self.new_token_ids + later.new_token_ids,
            new_text=self.new_text + later.new_text, finish_reason=later.finish_reason,
            stop_reason=later.stop_reason, new_logprobs=new_logprobs, logprobs=later.logprobs,
            metrics=later.metrics, error=later.error, prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
            index=self.index)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (known once finished)."""
        return self.metrics.num_cached_tokens if self.metrics is not None else 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks published to the prefix cache, in chain order: block i's parent is block
    i - 1, the first one's is parent_block_hash (None: the first block of a prompt)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]  # every block's tokens, concatenated (block_size each)
    block_size: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Published blocks evicted from the prefix cache (their block reused for new tokens)."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped (reset_prefix_cache)."""


KvCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class StepStats:
    """One engine step, for metrics and step spans."""

    step_id: int
    start_time: float  # monotonic
    num_waiting: int = 0
    num_running: int = 0
    kv_cache_usage: float = 0.0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_prefill_seqs: int = 0
    num_decode_seqs: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_prefix_queried_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_verify_tokens: int = 0  # speculative decoding: each verifying decode's last token and its drafts
    spec_method: str = "none"
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # drafts accepted, per verification
    budget_source: str = "tokens"  # what sized the prefill: "tokens" or "time"
    step_time_target: float | None = None  # seconds, when the time budget applied
    predicted_step_time: float | None = None  # seconds, by the learned cost model
    schedule_time: float = 0.0
    forward_time: float = 0.0  # the model forward over all scheduled tokens and the logits
    prepare_time: float = 0.0  # host-side input building (not in forward_time)
    sample_time: float = 0.0
    process_time: float = 0.0
    # Mixture of experts: distinct experts the step's forward ran, summed over its MoE layers (the
    # sum is what the step's expert weight reads follow), and the model's MoE layers (0: dense,
    # whose steps touch no experts).
    num_experts_touched: int = 0
    num_moe_layers: int = 0
    prefill_request_ids: list[str] = field(default_factory=list)
    decode_request_ids: list[str] = field(default_factory=list)
    times_to_first_token: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[RequestMetrics] = field(default_factory=list)
    kv_events: list[KvCacheEvent] = field(default_factory=list)  # prefix-cache changes, in order

    @property
    def kind(self) -> str:
        """prefill, decode or mixed: which paths the step's forward ran (idle: no forward)."""
        if self.num_prefill_tokens and self.num_decode_tokens:
            return "mixed"
        return "prefill" if self.num_prefill_tokens else "decode" if self.num_decode_tokens else "idle"

    @property
    def experts_touched_per_layer(self) -> float | None:
        """Distinct experts per MoE layer, the mean over layers (comparable with the model's
        expert count whatever its depth); None for a dense model or a step without a forward."""
        if not self.num_moe_layers or not (self.num_prefill_tokens or self.num_decode_tokens):
            return None
        return self.num_experts_touched / self.num_moe_layers

    @property
    def total_time(self) -> float:
        return self.schedule_time + self.prepare_time + self.forward_time + self.sample_time + self.process_time

    @property
    def overhead_time(self) -> float:
        """Time outside the model forward: scheduling, input preparation, sampling, output processing."""
        return self.schedule_time + self.prepare_time + self.sample_time + self.process_time


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the engine serves and its limits (for GetModelInfo and `minivllm info`)."""

    model_name: str
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_num_waiting: int
    block_size: int
    num_kv_blocks: int
    device: str
    dtype: str
    eos_token_ids: tuple[int, ...]
    has_chat_template: bool
    kv_cache_dtype: str
    # Where the served files are, as the engine resolved them (the service never resolves a
    # model itself): the model's HF directory (for a GGUF file served as its blocks, its config
    # and tokenizer only) and the tokenizer's directory. Local paths: not part of the wire message.
    model_dir: str
    tokenizer_dir: str
    task: str = "generate"  # what the model is served for: generate | embed | score (EngineConfig.task, settled)
    hidden_size: int = 0  # an embedding's dimensions at most
    uses_token_types: bool = False  # the model reads each token's segment (a BERT cross-encoder's pair)
    # Task score on a causal LM: the label tokens its LM head scores by (Qwen3-Reranker's no, yes),
    # whose pairs the doors wrap in that reranker's prompt; empty for a sequence classifier.
    score_label_tokens: tuple[str, ...] = ()
