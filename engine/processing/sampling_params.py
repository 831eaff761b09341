"""Per-request sampling and stopping parameters, validated at construction."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import FieldError
from engine.processing.structured_output import StructuredOutput

_MAX_LOGPROBS = 20
_MAX_LOGIT_BIAS = 100.0
_MAX_N = 128  # OpenAI's range: -100 bans a token, +100 all but forces it


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 means greedy.

    Bad values raise FieldError naming the field, so the service can answer INVALID_ARGUMENT.
    """

    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (the sampled one always)
    skip_special_tokens: bool = True
    structured_output: StructuredOutput | None = None  # constrain decoding (JSON schema, regex, ...)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    truncate_prompt_tokens: int | None = None  # keep only the last N prompt tokens
    include_stop_str_in_output: bool = False  # keep the matched stop string at the end of the text
    prompt_logprobs: int | None = None  # top-N logprobs of every prompt position (and the actual token's)
    n: int = 1  # samples of the prompt; they share its KV blocks (sample i is seeded with seed + i)
    stop_token_set: frozenset[int] = field(init=False, repr=False, compare=False)  # built once, read per token
    # The sampler's per-row values, built once per request (the sampler stacks them per step):
    # (temperature or 1 when greedy, top_p, min_p, repetition, frequency, presence penalty, is_greedy)
    row: tuple[float, ...] = field(init=False, repr=False, compare=False)
    # Greedy with nothing that edits logits or reads them (a grammar, penalties, biases,
    # logprobs; min_tokens is per step): the sampler can take the forward's own argmax.
    is_plain_greedy: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):  # NaN slips through every range check below
                raise FieldError(name, f"must be a finite number, got {getattr(self, name)}", sep=" ")
        if self.temperature < 0:
            raise FieldError("temperature", f"must be >= 0, got {self.temperature}", sep=" ")
        if self.top_k < -1:
            raise FieldError("top_k", f"must be -1, 0 (disabled) or positive, got {self.top_k}", sep=" ")
        if not 0.0 < self.top_p <= 1.0:
            raise FieldError("top_p", f"must be in (0, 1], got {self.top_p}", sep=" ")
        if not 0.0 <= self.min_p <= 1.0:
            raise FieldError("min_p", f"must be in [0, 1], got {self.min_p}", sep=" ")
        if self.repetition_penalty <= 0:
            raise FieldError("repetition_penalty", f"must be > 0, got {self.repetition_penalty}", sep=" ")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise FieldError("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}", sep=" ")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise FieldError("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}", sep=" ")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise FieldError("max_tokens", f"must be >= 1, got {self.max_tokens}", sep=" ")
        if self.min_tokens < 0:
            raise FieldError("min_tokens", f"must be >= 0, got {self.min_tokens}", sep=" ")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise FieldError("min_tokens", f"({self.min_tokens}) must be <= {{0}} ({self.max_tokens})",
                             mentions=("max_tokens",), sep=" ")
        if any(not s for s in self.stop):
            raise FieldError("stop", "must not contain empty strings", sep=" ")
        if any(t < 0 for t in self.stop_token_ids):
            raise FieldError("stop_token_ids", "must be non-negative", sep=" ")
        if self.logprobs is not None and not 0 <= self.logprobs <= _MAX_LOGPROBS:
            raise FieldError("logprobs", f"must be in [0, {_MAX_LOGPROBS}], got {self.logprobs}", sep=" ")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise FieldError("seed", f"must be in [0, 2**63), got {self.seed}", sep=" ")
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            for token_id, bias in self.logit_bias.items():
                if token_id < 0:
                    raise FieldError("logit_bias", f"token id {token_id} is negative")
                if not math.isfinite(bias) or not -_MAX_LOGIT_BIAS <= bias <= _MAX_LOGIT_BIAS:
                    raise FieldError("logit_bias", f"the bias of token {token_id} must be in "
                                     f"[{-_MAX_LOGIT_BIAS:g}, {_MAX_LOGIT_BIAS:g}], got {bias}")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise FieldError("truncate_prompt_tokens", f"must be >= 1, got {self.truncate_prompt_tokens}", sep=" ")
        if not 1 <= self.n <= _MAX_N:
            raise FieldError("n", f"must be in [1, {_MAX_N}], got {self.n}", sep=" ")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= _MAX_LOGPROBS:
            raise FieldError("prompt_logprobs", f"must be in [0, {_MAX_LOGPROBS}], got {self.prompt_logprobs}", sep=" ")
        self.stop_token_set = frozenset(self.stop_token_ids)
        self.is_plain_greedy = (self.is_greedy and self.logprobs is None and not self.logit_bias
                                and not self.has_penalties and self.structured_output is None)
        self.row = (self.temperature if self.temperature > 0 else 1.0, self.top_p, self.min_p, self.repetition_penalty,
                    self.frequency_penalty, self.presence_penalty, float(self.is_greedy))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)
