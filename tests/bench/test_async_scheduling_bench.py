"""bench.async_scheduling's figures: a stream's pace by the wall clock between decode steps."""
from __future__ import annotations

import pytest

from bench.async_scheduling import host_time, step_period
from engine.outputs import StepStats


def _step(start: float, prefill: int = 0, decode: int = 1, schedule: float = 0.0, process: float = 0.0) -> StepStats:
    return StepStats(step_id=0, start_time=start, num_prefill_tokens=prefill, num_decode_tokens=decode,
                     schedule_time=schedule, process_time=process)


def test_the_period_is_the_median_gap_between_decode_steps_only() -> None:
    # A prefill step's gap (10 -> 10.5) and the gap after it never count; the parts of a step do not either.
    steps = [_step(10.0, prefill=64, decode=0), _step(10.5), _step(10.52, schedule=0.004), _step(10.54),
             _step(10.60), _step(10.62, prefill=8)]
    assert step_period(steps) == pytest.approx(0.02)
    assert step_period(steps[:2]) is None


def test_host_time_is_the_median_of_decode_steps_scheduling_and_processing() -> None:
    steps = [_step(0, prefill=64, decode=0, schedule=1.0, process=1.0), _step(1, schedule=0.001, process=0.002),
             _step(2, schedule=0.002, process=0.002), _step(3, schedule=0.003, process=0.009)]
    assert host_time(steps) == pytest.approx(0.004)
