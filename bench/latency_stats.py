"""Percentiles, summaries and goodput over measured latencies (pure functions, unit-tested), and a timer."""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile (0..100) with linear interpolation between ranks (numpy's default)."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """mean, median, p90, p99 (NaN when there are no values)."""
    if not values:
        return {"mean": math.nan, "median": math.nan, "p90": math.nan, "p99": math.nan}
    return {"mean": sum(values) / len(values), "median": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99)}


def goodput(requests: Sequence[dict[str, float | None]], slos: dict[str, float], duration_s: float) -> float:
    """Requests per second that met every SLO.

    requests: one dict per completed request with the metrics named in slos (ttft, tpot, e2el,
    in seconds); slos: metric -> limit in seconds. A request missing a metric that has an SLO
    (e.g. no TPOT for a one-token reply) counts as meeting that SLO, as in vLLM's benchmark.
    """
    if duration_s <= 0:
        raise ValueError("duration_s must be positive")
    good = 0
    for req in requests:
        if all(req.get(name) is None or req[name] <= limit for name, limit in slos.items()):
            good += 1
    return good / duration_s


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of fn takes (wall clock)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
