"""The backward match both proposers search with: the longest run of a request's last tokens
that occurs earlier, found by narrowing every occurrence of its last token a token at a time
(one vectorised comparison per extra token, never a Python loop over the history), over one or
several token sources at once. Once few occurrences are left, the remaining depths are compared
in one [occurrences, depths] gather instead of one narrowing per depth."""
from __future__ import annotations

import numpy as np

_MAX_WINDOW_ROWS = 256  # occurrences left, at most, for the one-gather comparison


def longest_backward_matches(sources: list[tuple[np.ndarray, np.ndarray]], pattern: np.ndarray,
                             max_length: int) -> tuple[int, list[np.ndarray]]:
    """sources: (haystack [H], ends [E]) pairs, ends the positions in haystack that hold
    pattern[-1]; pattern: [P] the tokens to match, read backwards from its end -> (n, per source
    its ends e with haystack[e - n + 1 .. e] == pattern[-n:]), n the longest such length over
    all sources, at most max_length and P (1 if no end matches further). A match never runs
    before its haystack's start."""
    matched = [ends for _, ends in sources]
    depth, max_depth = 1, min(max_length, len(pattern))
    while depth < max_depth and sum(ends.size for ends in matched) > _MAX_WINDOW_ROWS:
        narrowed = []
        for (haystack, _), ends in zip(sources, matched, strict=True):
            if ends.size:
                before = ends - depth
                keep = before >= 0
                keep[keep] = haystack[before[keep]] == pattern[-1 - depth]
                ends = ends[keep]
            narrowed.append(ends)
        if not any(ends.size for ends in narrowed):
            return depth, matched
        matched, depth = narrowed, depth + 1
    if depth >= max_depth:
        return depth, matched
    depths = np.arange(depth, max_depth)  # [D] the depths still to compare
    wanted = pattern[-1 - depths]  # [D]
    runs = []  # per source [E]: how many of those depths each end goes on matching
    for (haystack, _), ends in zip(sources, matched, strict=True):
        before = ends[:, None] - depths  # [E, D]
        equal = (haystack[np.maximum(before, 0)] == wanted) & (before >= 0)  # [E, D]
        runs.append(np.logical_and.accumulate(equal, axis=1).sum(axis=1))
    longest = max(int(run.max(initial=0)) for run in runs)
    return depth + longest, [ends[run == longest] for ends, run in zip(matched, runs, strict=True)]
