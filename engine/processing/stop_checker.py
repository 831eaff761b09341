"""Stop strings: where one ends the text, and how much of the text may be shown yet (the
token-level stops are the scheduler's: Sequence.check_stop)."""
from __future__ import annotations

from engine.processing.sampling_params import SamplingParams


def find_stop_string(text: str, num_new_chars: int, params: SamplingParams) -> tuple[int, str] | None:
    """Earliest stop string that the new text (its last num_new_chars) completes: (its start, the string)."""
    search_from = max(0, len(text) - num_new_chars - params.max_stop_len + 1)
    best: tuple[int, str] | None = None
    for stop in params.stop:
        idx = text.find(stop, search_from)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best


def num_held_chars(text: str, stops: list[str]) -> int:
    """Length of the longest tail of text that could still grow into a stop string."""
    held = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:k]):
                held = k
                break
    return held
