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

from collections import deque

import numpy as np

from engine.execution.speculative.proposer import Proposer

_MAX_DEPTH = 24  # longest suffix matched
_MIN_AGREEMENT = 0.5  # a continuation token's share of the matches needed to follow it
_MAX_HISTORY_TOKENS = 32768  # recent outputs kept (the oldest leave first)
_SEPARATOR = -1  # between sources in the corpus: no match runs across it


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
        # The corpus: recent outputs, then the request itself but for its last token (whose
        # continuation is what we look for).
        corpus = np.concatenate((self._shared, token_ids[:-1], [_SEPARATOR]))
        # ends: positions i whose tokens corpus[i - d .. i] equal the request's last d + 1 tokens.
        ends = np.flatnonzero(corpus == token_ids[-1])
        depth = 1
        while depth < min(_MAX_DEPTH, len(token_ids)):
            before = ends - depth
            keep = before >= 0
            keep[keep] = corpus[before[keep]] == token_ids[-1 - depth]
            if not keep.any():
                break
            ends, depth = ends[keep], depth + 1
        if ends.size == 0:
            return []
        drafts: list[int] = []
        positions = ends + 1  # where each match's continuation starts
        limit = min(self.num_tokens, depth)
        while len(drafts) < limit:
            following = corpus[positions[positions < len(corpus)]]
            following = following[following != _SEPARATOR]
            if following.size == 0:
                break
            values, counts = np.unique(following, return_counts=True)
            best = int(counts.argmax())
            if counts[best] < _MIN_AGREEMENT * positions.size:
                break
            token = int(values[best])
            drafts.append(token)
            positions = positions[(positions < len(corpus)) & (corpus[np.minimum(positions, len(corpus) - 1)] == token)]
            positions = positions + 1
        return drafts
