"""Predicts how long a step will take, from costs learned online from the engine's own steps.

Each forward path is a small linear model fitted by exponentially weighted recursive least
squares (forgetting factor `decay`, so it follows a machine whose speed drifts):
- decode:  t = w0 + w1 * sequences + w2 * (context tokens read) / 1000
- prefill: t = w0 + w1 * tokens + w2 * (query x key pairs of attention) / 1e6
and host overhead (schedule, input preparation, sampling, output processing) is an
exponentially weighted mean per step. The intercepts matter: on a CPU a forward first streams
every weight from memory, which costs the same for 1 row as for 30.

Nothing here is tuned to one machine: the prior only says "a prefill token costs about a
millisecond" with a wide variance, and a handful of steps replace it with measurements.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class RecursiveLeastSquares:
    """w minimising sum_i decay^(n-i) (y_i - w.x_i)^2 + a prior, updated in O(features^2)."""

    def __init__(self, prior: list[float], prior_variance: list[float], decay: float = 0.97) -> None:
        self.weights = np.asarray(prior, dtype=np.float64)
        self.covariance = np.diag(np.asarray(prior_variance, dtype=np.float64))
        self.decay = decay
        self.num_updates = 0

    def predict(self, features: np.ndarray) -> float:
        # Negative fitted costs are noise: a feature never makes a step faster.
        return float(np.maximum(self.weights, 0.0) @ features)

    def update(self, features: np.ndarray, target: float) -> None:
        p_x = self.covariance @ features
        gain = p_x / (self.decay + features @ p_x)
        self.weights = self.weights + gain * (target - features @ self.weights)
        self.covariance = (self.covariance - np.outer(gain, p_x)) / self.decay
        self.num_updates += 1


@dataclass(slots=True)
class PrefillChunk:
    num_tokens: int  # new tokens this step
    num_context_tokens: int  # tokens already in the cache before them


def decode_features(num_seqs: int, num_context_tokens: int) -> np.ndarray:
    return np.array([1.0 if num_seqs else 0.0, num_seqs, num_context_tokens / 1e3])


def prefill_features(chunks: list[PrefillChunk]) -> np.ndarray:
    num_tokens = sum(c.num_tokens for c in chunks)
    # Each new token attends to the cached context and to the new tokens before it.
    pairs = sum(c.num_tokens * c.num_context_tokens + c.num_tokens * (c.num_tokens + 1) / 2 for c in chunks)
    return np.array([1.0 if num_tokens else 0.0, num_tokens, pairs / 1e6])


class StepCostModel:
    def __init__(self, decay: float = 0.97) -> None:
        self.decode = RecursiveLeastSquares([0.0, 1e-3, 1e-3], [1e-2, 1e-4, 1e-4], decay)
        self.prefill = RecursiveLeastSquares([0.0, 1e-3, 1e-2], [1e-2, 1e-4, 1e-2], decay)
        self.overhead = 0.0
        self._overhead_decay = decay
        self.num_observations = 0

    def predict_decode(self, num_seqs: int, num_context_tokens: int) -> float:
        return self.decode.predict(decode_features(num_seqs, num_context_tokens)) if num_seqs else 0.0

    def predict_prefill(self, chunks: list[PrefillChunk]) -> float:
        return self.prefill.predict(prefill_features(chunks)) if chunks else 0.0

    def predict_step(self, num_decode_seqs: int, num_decode_context_tokens: int, chunks: list[PrefillChunk]) -> float:
        return (self.overhead + self.predict_decode(num_decode_seqs, num_decode_context_tokens)
                + self.predict_prefill(chunks))

    def max_chunk(self, time_left: float, num_context_tokens: int, has_prefill: bool, limit: int) -> int:
        """The most new tokens (<= limit) of one sequence whose prefill fits in time_left seconds,
        given that the step already has prefill chunks (the path's fixed cost is paid) or not."""
        w0, w1, w2 = np.maximum(self.prefill.weights, 0.0)
        budget = time_left - (0.0 if has_prefill else w0)
        if budget <= 0:
            return 0
        # w1 n + w2 (n c + n (n + 1) / 2) / 1e6 <= budget: a quadratic in n.
        a = w2 / 2e6
        b = w1 + w2 * (num_context_tokens + 0.5) / 1e6
        n = budget / b if a <= 0 else (-b + (b * b + 4 * a * budget) ** 0.5) / (2 * a)
        return max(0, min(limit, int(n)))

    def observe(self, num_decode_seqs: int, num_decode_context_tokens: int, decode_time: float,
                chunks: list[PrefillChunk], prefill_time: float, overhead_time: float) -> None:
        """Fold in one step's measured forward times (seconds) per path and its host overhead."""
        if num_decode_seqs:
            self.decode.update(decode_features(num_decode_seqs, num_decode_context_tokens), decode_time)
        if chunks:
            self.prefill.update(prefill_features(chunks), prefill_time)
        if self.num_observations == 0:
            self.overhead = overhead_time
        else:
            self.overhead = self._overhead_decay * self.overhead + (1 - self._overhead_decay) * overhead_time
        self.num_observations += 1
