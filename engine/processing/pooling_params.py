"""Per-request pooling parameters: a request that asks for an embedding or a score instead of tokens.

Such a request runs its prompt's prefill only (chunked and batched like any prompt); the runner
pools the final-normed hidden states of its tokens when the last chunk finishes, and the request
ends there with its output, its KV blocks freed. An embed request's output is the vector: the
model's own defaults (sentence-transformers' pooling mode and Normalize module) fill what it
leaves unset (`PoolingParams.resolved`). A score request's is the model's score head on the state
at the head's own position (a cross-encoder's or a reranker's raw logits, one per label).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from engine.errors import FieldError


class PoolingTask(enum.StrEnum):
    EMBED = "embed"  # the pooled vector
    SCORE = "score"  # the score head's raw logits of the pooled state [num_labels] (rerankers)


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
    """How to pool a prompt into one vector (task embed) or score it (task score). None: the
    model's default.

    dimensions: Matryoshka truncation, the first `dimensions` values kept (then normalised when
    normalize is on), as OpenAI's `dimensions` and sentence-transformers' `truncate_dim`. A score
    request takes none of pooling_type, normalize and dimensions: its head decides where it reads.
    """

    pooling_type: PoolingType | str | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    task: PoolingTask | str = PoolingTask.EMBED

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "task", PoolingTask(self.task))
        except ValueError:
            raise FieldError("task", f"must be one of {[t.value for t in PoolingTask]}, got {self.task!r}",
                             sep=" ") from None
        if self.pooling_type is not None:
            try:
                object.__setattr__(self, "pooling_type", PoolingType(self.pooling_type))
            except ValueError:
                raise FieldError("pooling_type", f"must be one of {[t.value for t in PoolingType]}, "
                                 f"got {self.pooling_type!r}", sep=" ") from None
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise FieldError("dimensions", f"must be a positive integer, got {self.dimensions!r}", sep=" ")

    def resolved(self, defaults: PoolerConfig, hidden_size: int,
                 score_pooling_type: PoolingType | None = None) -> PoolingParams:
        """Every field set, from the model's defaults where this request left it unset; a
        `dimensions` over the model's hidden size is refused (FieldError naming it).
        score_pooling_type: where the model's score head reads (None: the model cannot score, and
        a score request is refused naming `task`)."""
        if self.task is PoolingTask.SCORE:
            for name in ("pooling_type", "normalize", "dimensions"):
                if getattr(self, name) is not None:
                    raise FieldError(name, "applies to embed requests only, not to score requests", sep=" ")
            if score_pooling_type is None:
                raise FieldError("task", "score needs a model with a score head (a sequence classifier, or a "
                                 "causal LM served with --task score)", sep=" ")
            return replace(self, pooling_type=score_pooling_type, normalize=False)
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise FieldError("dimensions", f"{self.dimensions} exceeds the model's {hidden_size} dimensions", sep=" ")
        return replace(self, pooling_type=self.pooling_type or defaults.pooling_type,
                       normalize=defaults.normalize if self.normalize is None else self.normalize)
