"""Predicts how long a step will take, from costs learned online from the engine's own steps.

A step is one forward over its prefill and decode tokens, so its time is modelled as
    t = w0 + w1 * decode sequences + w2 * decode context tokens / 1e3
           + w3 * prefill tokens + w4 * prefill attention pairs / 1e6 + w5 * (any prefill)
           + w6 * cached tokens the chunks read / 1e3 + host overhead
fitted by exponentially weighted recursive least squares (forgetting factor `decay`, so it
follows a machine whose speed drifts). w0 matters: on a CPU every forward first streams all
weights from memory, which costs as much for one row as for a batch; w5 is what a step pays once
for having prefill rows (per-layer attention set-up), kept apart so it does not leak into the
decode-only prediction that the auto target is a multiple of; w6 is what a chunk pays per
cached token whatever its own length (the C++ prefill kernel lays each layer's cached K/V out
for its tiles), which pairs alone under-predict for the small chunks a time budget cuts. The
host overhead (schedule, input preparation, sampling, output processing) is an exponentially
weighted mean.

A mixture-of-experts model's step reads the weights of the experts its tokens are routed to, each
once, whatever its rows: its cost grows with the distinct experts it touches, which saturate at
the model's count, not with its tokens. The scheduler predicts before routing, so a MoE model
(`experts`: E experts, k a token) adds one feature, the experts n tokens are expected to touch
in one layer if each picks k of E uniformly,
    + w7 * E (1 - (1 - k / E)^n),        n = decode sequences + prefill tokens
learned like the others (w7 holds every layer's share and an expert's read time). A dense model
has the seven features alone, as before.

The model also tracks how far it errs: an online estimate of the 97th percentile of
measured / predicted step time, so the scheduler can aim below the target by that margin and
keep 97 steps in 100 under it on a machine whose speed jitters (a p99 inter-token latency sees
what a lower percentile leaves over the target).

Nothing here is tuned to one machine: the prior only says "a token costs about a millisecond"
with a wide variance, and a handful of steps replace it with measurements.
"""
from __future__ import annotations

import math
import operator

_PRIOR = [0.0, 1e-3, 1e-3, 1e-3, 1e-2, 0.0, 1e-3]
_PRIOR_VARIANCE = [1.0, 1e-2, 1e-2, 1e-2, 1.0, 1.0, 1e-2]
_EXPERT_PRIOR, _EXPERT_PRIOR_VARIANCE = 1e-4, 1e-2  # seconds per expected expert of a layer
_MAX_VARIANCE_GROWTH = 100.0  # a feature unseen for long regains at most this much uncertainty
ERROR_QUANTILE = 0.97
_QUANTILE_STEP = 0.01  # how far one step moves the error quantile estimate


def _dot(a: list[float], b: list[float]) -> float:
    return sum(map(operator.mul, a, b))


def attention_pairs(num_new_tokens: int, num_context_tokens: int) -> float:
    """Query-key pairs of a chunk: each new token sees the cached context and the new tokens up to it."""
    return num_new_tokens * num_context_tokens + num_new_tokens * (num_new_tokens + 1) / 2


def expected_experts(num_tokens: int, num_experts: int, num_experts_per_tok: int) -> float:
    """Distinct experts of one layer that num_tokens tokens touch, each routed to k of E
    uniformly: E (1 - (1 - k / E)^n)."""
    return num_experts * (1.0 - (1.0 - num_experts_per_tok / num_experts) ** num_tokens)


class StepCostModel:
    def __init__(self, decay: float = 0.98, experts: tuple[int, int] | None = None) -> None:
        """experts: a mixture-of-experts model's (experts, experts a token); None: dense."""
        if experts is not None and not 0 < experts[1] <= experts[0]:
            raise ValueError(f"experts: (experts, experts a token) must satisfy 0 < k <= E, got {experts}")
        self.experts = experts
        prior = _PRIOR + ([_EXPERT_PRIOR] if experts else [])
        variance = _PRIOR_VARIANCE + ([_EXPERT_PRIOR_VARIANCE] if experts else [])
        # Plain floats, not numpy: a 7-feature fit is a few hundred multiplications, and each
        # numpy call found the caches cold after a batch-1 step's weight stream.
        self.weights = list(prior)
        self.covariance = [[v if i == j else 0.0 for j in range(len(prior))] for i, v in enumerate(variance)]
        self._max_variance = [v * _MAX_VARIANCE_GROWTH for v in variance]
        self.decay = decay
        self.overhead = 0.0
        self.error_quantile = 1.0  # online ERROR_QUANTILE of measured / predicted step time
        self.num_observations = 0
        self.num_decode_only_observations = 0

    def features(self, num_decode_seqs: int, num_decode_context_tokens: int, num_prefill_tokens: int,
                 num_prefill_pairs: float, num_prefill_cached_tokens: int = 0) -> list[float]:
        is_forward = 1.0 if num_decode_seqs or num_prefill_tokens else 0.0
        has_prefill = 1.0 if num_prefill_tokens else 0.0
        x = [is_forward, float(num_decode_seqs), num_decode_context_tokens / 1e3, float(num_prefill_tokens),
             num_prefill_pairs / 1e6, has_prefill, num_prefill_cached_tokens / 1e3]
        if self.experts is not None:
            x.append(self._experts_of(num_decode_seqs + num_prefill_tokens))
        return x

    def _experts_of(self, num_tokens: int) -> float:
        return 0.0 if self.experts is None else expected_experts(num_tokens, *self.experts)

    @property
    def costs(self) -> list[float]:
        # A negative fitted cost is noise: more work never makes a step faster.
        return [max(w, 0.0) for w in self.weights]

    def predict(self, num_decode_seqs: int, num_decode_context_tokens: int, num_prefill_tokens: int = 0,
                num_prefill_pairs: float = 0.0, num_prefill_cached_tokens: int = 0) -> float:
        """Predicted step time (seconds), host overhead included."""
        x = self.features(num_decode_seqs, num_decode_context_tokens, num_prefill_tokens, num_prefill_pairs,
                          num_prefill_cached_tokens)
        # The raw fit, not the clipped costs: with correlated features one weight may go negative
        # while the sum stays right, and clipping it would bias every prediction upwards.
        return self.overhead + max(0.0, _dot(self.weights, x))

    def decode_pace(self, decode_time: float) -> float:
        """The time of a decode-only step whose sequences `predict` puts at decode_time (seconds),
        as far as the steps seen so far can tell. Until one of them was decode-only,
        w0 (the weights' read) and w5 (the prefill set-up) were one constant to the fit, split by
        their priors (evenly): the pace of a step that also sets up prefill is then what is known,
        and w0 alone is about half the truth. Seen in a served closed loop, whose requests arrive
        one after another from the start: w0 and w5 came out equal, a target built on w0 fell far
        below the real steps, and chunks were held to one block for dozens of steps."""
        return decode_time if self.num_decode_only_observations else decode_time + self.costs[5]

    def chunk_cost(self, num_new_tokens: int, num_context_tokens: int, is_first: bool = False,
                   num_step_tokens: int = 0) -> float:
        """What adding one prefill chunk to a step that already runs a forward adds to it
        (is_first: the step has no prefill chunk yet, so it also pays the prefill set-up;
        num_step_tokens: the tokens the step has already, whose experts a MoE chunk shares)."""
        c = self.costs
        fixed = (c[5] if is_first else 0.0) + c[6] * num_context_tokens / 1e3
        cost = fixed + c[3] * num_new_tokens + c[4] * attention_pairs(num_new_tokens, num_context_tokens) / 1e6
        if self.experts is not None:
            cost += c[7] * (self._experts_of(num_step_tokens + num_new_tokens) - self._experts_of(num_step_tokens))
        return cost

    def max_chunk(self, time_left: float, num_context_tokens: int, limit: int, is_first: bool = False,
                  num_step_tokens: int = 0) -> int:
        """The most new tokens (<= limit) of one sequence whose chunk fits in time_left seconds."""
        c = self.costs
        if self.experts is not None and c[7] > 0:
            # The experts' term is no polynomial: the cost grows with n, so bisect it.
            if self.chunk_cost(limit, num_context_tokens, is_first, num_step_tokens) <= time_left:
                return limit
            low, high = 0, limit  # chunk_cost(low) fits (or low is 0), chunk_cost(high) does not
            while high - low > 1:
                mid = (low + high) // 2
                if self.chunk_cost(mid, num_context_tokens, is_first, num_step_tokens) <= time_left:
                    low = mid
                else:
                    high = mid
            return low
        time_left -= (c[5] if is_first else 0.0) + c[6] * num_context_tokens / 1e3
        if time_left <= 0:
            return 0
        # c3 n + c4 (n ctx + n (n + 1) / 2) / 1e6 <= time_left: a quadratic in n.
        a = c[4] / 2e6
        b = c[3] + c[4] * (num_context_tokens + 0.5) / 1e6
        if a <= 0 and b <= 0:
            return limit
        n = time_left / b if a <= 0 else (-b + (b * b + 4 * a * time_left) ** 0.5) / (2 * a)
        return max(0, min(limit, int(n)))

    def observe(self, num_decode_seqs: int, num_decode_context_tokens: int, num_prefill_tokens: int,
                num_prefill_pairs: float, num_prefill_cached_tokens: int, forward_time: float,
                overhead_time: float) -> None:
        """Fold in one step's measured forward time and host overhead (seconds)."""
        x = self.features(num_decode_seqs, num_decode_context_tokens, num_prefill_tokens, num_prefill_pairs,
                          num_prefill_cached_tokens)
        if self.num_observations >= 10:  # once the fit means something
            predicted = self.overhead + max(0.0, _dot(self.weights, x))
            if predicted > 0:
                # Stochastic quantile tracking: up by q when above, down by 1 - q when below.
                above = (forward_time + overhead_time) / predicted > self.error_quantile
                self.error_quantile += _QUANTILE_STEP * (ERROR_QUANTILE if above else ERROR_QUANTILE - 1)
        # A decode-only step has 3 non-zero features of 7 (4 of 8): P x and the dots run over those alone.
        nonzero = [(j, v) for j, v in enumerate(x) if v]
        covariance, decay = self.covariance, self.decay
        p_x = [sum(row[j] * v for j, v in nonzero) for row in covariance]  # P x
        denominator = decay + sum(v * p_x[j] for j, v in nonzero)
        step = (forward_time - sum(v * self.weights[j] for j, v in nonzero)) / denominator  # error / denominator
        self.weights = [w + p * step for w, p in zip(self.weights, p_x, strict=True)]  # w + gain error
        # P' = (P - (P x)(P x)^T / denominator) / decay, through q = P x / sqrt(denominator) so that
        # every entry's rounding is the same as its mirror's: an asymmetric part is not corrected by
        # the update, and forgetting grew it by 1 / decay a step until P lost its positive
        # definiteness and the fit diverged.
        root = math.sqrt(denominator)
        q = [p / root for p in p_x]
        # Forgetting inflates the variance of features a workload never varies (windup): each
        # entry is scaled by s_i s_j in the same pass, s capping the new diagonal.
        scale = [math.sqrt(min(1.0, m / max((row[i] - qi * qi) / decay, 1e-30)))
                 for i, (row, qi, m) in enumerate(zip(covariance, q, self._max_variance, strict=True))]
        self.covariance = [[(c - qi * qj) * (si * sj) / decay for c, qj, sj in zip(row, q, scale, strict=True)]
                           for row, qi, si in zip(covariance, q, scale, strict=True)]
        self.overhead = self._smooth(self.overhead, overhead_time, self.num_observations == 0)
        self.num_observations += 1
        self.num_decode_only_observations += bool(num_decode_seqs and not num_prefill_tokens)

    def _smooth(self, average: float, value: float, is_first: bool) -> float:
        return value if is_first else self.decay * average + (1 - self.decay) * value
