"""Suffix decoding (after Suffix Decoding, arXiv 2411.04975): the longest suffix of the request
that occurs in its own tokens or in recent requests' outputs, and the continuation the matches
agree on most, followed for as long as they keep agreeing; the speculation length adapts to the
match (at most the matched length, and k).

The paper walks a suffix tree with frequency counts; this walks the same tree implicitly, over
arrays: every position whose preceding tokens equal the request's suffix is a node's occurrence,
and narrowing the set of positions token by token (vectorised) is descending the tree. Agents
repeating tool output and requests that restate earlier answers are what the shared part serves.
"""
from __future__ import annotations

from collections import Counter, deque

import numpy as np

from engine.execution.speculative.backward_match import longest_backward_matches
from engine.execution.speculative.proposer import Proposer

_MAX_DEPTH = 24  # longest suffix matched
_MIN_AGREEMENT = 0.5  # a continuation token's share of the matches needed to follow it
_MAX_HISTORY_TOKENS = 32768  # recent outputs kept (the oldest leave first)
_SEPARATOR = -1  # between sources in the corpus: no match runs across it
# Matches counted with a Counter: below this many, numpy's per-call overhead costs more.
_MAX_COUNTED_IN_PYTHON = 64


class SuffixProposer(Proposer):
    method = "suffix"

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens
        self._history: deque[np.ndarray] = deque()
        self._num_history_tokens = 0
        self._shared = np.empty(0, dtype=np.int64)  # the history, concatenated with separators

    def observe_finished(self, token_ids: np.ndarray) -> None:
        self._history.append(np.asarray(token_ids, dtype=np.int64))
        self._num_history_tokens += len(token_ids)
        while self._num_history_tokens > _MAX_HISTORY_TOKENS and len(self._history) > 1:
            self._num_history_tokens -= len(self._history.popleft())
        parts = [part for tokens in self._history for part in (tokens, np.array([_SEPARATOR]))]
        self._shared = np.concatenate(parts)

    def reset(self) -> None:
        self._history.clear()
        self._num_history_tokens = 0
        self._shared = np.empty(0, dtype=np.int64)

    def propose(self, token_ids: np.ndarray) -> list[int]:
        if len(token_ids) < 2:
            return []
        # The corpus is two sources searched apart (joining them cost a copy of the whole history
        # per request per step): recent outputs, each followed by a separator, then the request
        # itself but for its last token (whose continuation is what we look for), followed by an
        # implicit one. A match or a continuation ends at a separator, so none spans the two.
        own = token_ids[:-1]
        last = token_ids[-1]
        shared_ends = np.flatnonzero(self._shared == last)
        own_ends = np.flatnonzero(own == last)
        if shared_ends.size + own_ends.size == 0:
            return []
        # ends: positions in either source whose tokens up to them equal the request's last
        # `depth` tokens, the longest suffix matched anywhere.
        depth, (shared_ends, own_ends) = longest_backward_matches([(self._shared, shared_ends), (own, own_ends)],
                                                                  token_ids, min(_MAX_DEPTH, len(token_ids)))
        limit = min(self.num_tokens, depth)
        # following: [M, limit] the tokens after each longest match, from either source. A row
        # is followed only while it agrees with the drafts, so a row stops counting at its first
        # separator: the history's trailing one (indices past it clip onto it) or the request's
        # implicit one at its last token.
        offsets = np.arange(1, limit + 1)  # [limit]
        shared_next = shared_ends[:, None] + offsets  # [S, limit]
        own_next = own_ends[:, None] + offsets  # [O, limit]
        num_own = len(own)
        following = np.concatenate((
            self._shared[np.minimum(shared_next, len(self._shared) - 1)] if shared_next.size
            else np.empty((0, limit), dtype=np.int64),
            np.where(own_next < num_own, own[np.minimum(own_next, num_own - 1)], _SEPARATOR)))
        drafts: list[int] = []
        for column in range(limit):
            candidates = following[:, column]  # [M]: every match still followed, at a separator or not
            tokens = candidates[candidates != _SEPARATOR]
            if tokens.size == 0:
                break
            token, count = _most_common(tokens)
            if count < _MIN_AGREEMENT * candidates.size:
                break
            drafts.append(token)
            following = following[candidates == token]
        return drafts


def _most_common(tokens: np.ndarray) -> tuple[int, int]:
    """tokens: [N], N > 0 -> the most frequent token (the smallest of a tie) and its count."""
    if tokens.size > _MAX_COUNTED_IN_PYTHON:
        values, counts = np.unique(tokens, return_counts=True)
        best = int(counts.argmax())
        return int(values[best]), int(counts[best])
    counts = Counter(tokens.tolist())
    count = max(counts.values())
    return min(token for token, n in counts.items() if n == count), count
