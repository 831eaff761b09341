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

from engine.execution.speculative.backward_match import backward_match_lengths
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
        # The corpus is two sources searched apart (joining them cost a copy of the whole history
        # per request per step): recent outputs, each followed by a separator, then the request
        # itself but for its last token (whose continuation is what we look for), followed by an
        # implicit one. A match or a continuation ends at a separator, so none spans the two.
        own = token_ids[:-1]
        last = token_ids[-1]
        max_depth = min(_MAX_DEPTH, len(token_ids))
        # ends: positions whose preceding tokens equal the request's longest matched suffix.
        shared_ends = np.flatnonzero(self._shared == last)
        own_ends = np.flatnonzero(own == last)
        shared_lengths = backward_match_lengths(self._shared, shared_ends, token_ids, max_depth)
        own_lengths = backward_match_lengths(own, own_ends, token_ids, max_depth)
        if shared_ends.size + own_ends.size == 0:
            return []
        depth = int(max(shared_lengths.max(initial=0), own_lengths.max(initial=0)))
        # Where each match's continuation starts: [S] in the history, [O] in the request.
        shared_next = shared_ends[shared_lengths == depth] + 1
        own_next = own_ends[own_lengths == depth] + 1
        drafts: list[int] = []
        limit = min(self.num_tokens, depth)
        while len(drafts) < limit:
            # The share counts every match still followed, those that just reached a separator
            # too. The history ends with a separator, so its continuations stay inside it; the
            # request's own stop at its last token (the implicit separator).
            num_matches = shared_next.size + own_next.size
            own_next = own_next[own_next < len(own)]
            following = np.concatenate((self._shared[shared_next], own[own_next]))
            following = following[following != _SEPARATOR]
            if following.size == 0:
                break
            values, counts = np.unique(following, return_counts=True)
            best = int(counts.argmax())
            if counts[best] < _MIN_AGREEMENT * num_matches:
                break
            token = int(values[best])
            drafts.append(token)
            shared_next = shared_next[self._shared[shared_next] == token] + 1
            own_next = own_next[own[own_next] == token] + 1
        return drafts
