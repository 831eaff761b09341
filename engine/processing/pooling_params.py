"""Per-request pooling parameters: a request that asks for an embedding instead of tokens.

Such a request runs its prompt's prefill only (chunked and batched like any prompt); the runner
pools the final-normed hidden states of its tokens when the last chunk finishes, and the request
ends there with the vector, its KV blocks freed. The model's own defaults (sentence-transformers'
pooling mode and Normalize module) fill what a request leaves unset (`PoolingParams.resolved`).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from engine.errors import FieldError


class PoolingType(enum.StrEnum):
    LAST = "last"  # the last token's hidden state: decoder embedders (Qwen3-Embedding, gte-Qwen2)
    CLS = "cls"  # the first token's
    MEAN = "mean"  # the mean over every prompt token


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """A model's pooling defaults (engine/execution/weights/pooling_config.py reads them)."""

    pooling_type: PoolingType = PoolingType.LAST
    normalize: bool = True


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """How to pool a prompt into one vector. None: the model's default.

    dimensions: Matryoshka truncation, the first `dimensions` values kept (then normalised when
    normalize is on), as OpenAI's `dimensions` and sentence-transformers' `truncate_dim`.
    """

    pooling_type: PoolingType | str | None = None
    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            try:
                object.__setattr__(self, "pooling_type", PoolingType(self.pooling_type))
            except ValueError:
                raise FieldError("pooling_type", f"must be one of {[t.value for t in PoolingType]}, "
                                 f"got {self.pooling_type!r}", sep=" ") from None
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise FieldError("dimensions", f"must be a positive integer, got {self.dimensions!r}", sep=" ")

    def resolved(self, defaults: PoolerConfig, hidden_size: int) -> PoolingParams:
        """Every field set, from the model's defaults where this request left it unset; a
        `dimensions` over the model's hidden size is refused (FieldError naming it)."""
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise FieldError("dimensions", f"{self.dimensions} exceeds the model's {hidden_size} dimensions", sep=" ")
        return replace(self, pooling_type=self.pooling_type or defaults.pooling_type,
                       normalize=defaults.normalize if self.normalize is None else self.normalize)
