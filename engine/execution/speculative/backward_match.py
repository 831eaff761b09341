"""The backward match both proposers search with: how far each candidate occurrence of a
request's last token keeps matching the tokens before it, for all candidates at once (one
vectorised comparison per extra token, never a Python loop over the history)."""
from __future__ import annotations

import numpy as np


def backward_match_lengths(haystack: np.ndarray, ends: np.ndarray, pattern: np.ndarray,
                           max_length: int) -> np.ndarray:
    """haystack: [H] tokens; ends: [E] positions in it that hold pattern[-1]; pattern: [P] the
    tokens to match, read backwards from its end -> [E] int64, for each end the number of
    tokens haystack[end - n + 1 .. end] == pattern[-n:] agree on, at least 1 and at most
    max_length (and P). A match never runs before haystack's start."""
    lengths = np.ones(ends.size, dtype=np.int64)  # [E]
    alive = np.ones(ends.size, dtype=bool)  # [E]: still matching at this depth
    for depth in range(1, min(max_length, len(pattern))):
        before = ends - depth
        alive &= before >= 0
        alive[alive] = haystack[before[alive]] == pattern[-1 - depth]
        if not alive.any():
            break
        lengths += alive
    return lengths
