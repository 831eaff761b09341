"""The proposers search the shared history and the request's own tokens apart (no per-step
concatenation); their proposals must equal, token for token, those of the straightforward
search over one concatenated corpus they replaced (kept here as the reference)."""
from __future__ import annotations

import random
from collections import deque
from unittest import mock

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.execution.speculative import NgramProposer, SuffixProposer, backward_match
from engine.execution.speculative import suffix_proposer as suffix_module

SEP = -1


class ReferenceSuffix:
    """Suffix decoding as it was: history and request joined into one corpus on every call."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens
        self.history: deque[np.ndarray] = deque()
        self.num_history_tokens = 0
        self.shared = np.empty(0, dtype=np.int64)

    def observe_finished(self, token_ids: np.ndarray) -> None:
        self.history.append(np.asarray(token_ids, dtype=np.int64))
        self.num_history_tokens += len(token_ids)
        while self.num_history_tokens > suffix_module._MAX_HISTORY_TOKENS and len(self.history) > 1:
            self.num_history_tokens -= len(self.history.popleft())
        self.shared = np.concatenate([p for t in self.history for p in (t, np.array([SEP]))])

    def propose(self, token_ids: np.ndarray) -> list[int]:
        if len(token_ids) < 2:
            return []
        corpus = np.concatenate((self.shared, token_ids[:-1], [SEP]))
        ends = np.flatnonzero(corpus == token_ids[-1])
        depth = 1
        while depth < min(suffix_module._MAX_DEPTH, len(token_ids)):
            before = ends - depth
            keep = before >= 0
            keep[keep] = corpus[before[keep]] == token_ids[-1 - depth]
            if not keep.any():
                break
            ends, depth = ends[keep], depth + 1
        if ends.size == 0:
            return []
        drafts: list[int] = []
        positions = ends + 1
        while len(drafts) < min(self.num_tokens, depth):
            following = corpus[positions[positions < len(corpus)]]
            following = following[following != SEP]
            if following.size == 0:
                break
            values, counts = np.unique(following, return_counts=True)
            best = int(counts.argmax())
            if counts[best] < suffix_module._MIN_AGREEMENT * positions.size:
                break
            drafts.append(int(values[best]))
            positions = positions[(positions < len(corpus)) &
                                  (corpus[np.minimum(positions, len(corpus) - 1)] == drafts[-1])] + 1
        return drafts


def reference_ngram(token_ids: np.ndarray, num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup as it was: every n from max_n down, the latest earlier occurrence."""
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        if n < 1:
            break
        suffix = token_ids[length - n:]
        for start in range(length - n - 1, -1, -1):
            if np.array_equal(token_ids[start:start + n], suffix):
                return token_ids[start + n:start + n + num_tokens].tolist()
    return []


tokens = st.lists(st.integers(0, 4), max_size=60)


@settings(max_examples=400, deadline=None)
@given(st.lists(tokens, max_size=6), st.lists(tokens.filter(len), min_size=1, max_size=4), st.integers(1, 10))
def test_suffix_proposals_equal_the_joined_corpus_search(histories: list[list[int]], requests: list[list[int]],
                                                        num_tokens: int) -> None:
    """Small alphabets: many matches, ties, matches at both sources' edges, continuations that
    reach a separator or the request's last token."""
    new, reference = SuffixProposer(num_tokens), ReferenceSuffix(num_tokens)
    for history in histories:
        new.observe_finished(np.array(history, dtype=np.int64))
        reference.observe_finished(np.array(history, dtype=np.int64))
    for request in requests:
        token_ids = np.array(request, dtype=np.int64)
        for end in range(1, len(token_ids) + 1):  # every step of the request's growth
            assert new.propose(token_ids[:end]) == reference.propose(token_ids[:end]), (histories, request, end)



@st.composite
def periodic(draw: st.DrawFn) -> list[int]:
    """A repeated unit with a few tokens changed: matches as long as the search goes (24 and
    more) beside ones a change cuts short at every length."""
    unit = draw(st.lists(st.integers(0, 3), min_size=1, max_size=5))
    out = (unit * 40)[: draw(st.integers(2, 120))]
    for position in draw(st.lists(st.integers(0, len(out) - 1), max_size=4)):
        out[position] = draw(st.integers(0, 4))
    return out


@settings(max_examples=150, deadline=None)
@given(st.lists(periodic(), max_size=4), periodic(), st.integers(1, 30))
def test_suffix_proposals_equal_on_long_matches(histories: list[list[int]], request: list[int],
                                                num_tokens: int) -> None:
    new, reference = SuffixProposer(num_tokens), ReferenceSuffix(num_tokens)
    for history in histories:
        new.observe_finished(np.array(history, dtype=np.int64))
        reference.observe_finished(np.array(history, dtype=np.int64))
    token_ids = np.array(request, dtype=np.int64)
    # Both ways of matching: narrowing a depth at a time (forced: no window) and the one-gather
    # window from the first depth on; and both ways of counting votes.
    for max_rows, max_counted in ((0, 0), (10**9, 10**9)):
        with mock.patch.object(backward_match, "_MAX_WINDOW_ROWS", max_rows), \
                mock.patch.object(suffix_module, "_MAX_COUNTED_IN_PYTHON", max_counted):
            for end in range(1, len(token_ids) + 1):
                assert new.propose(token_ids[:end]) == reference.propose(token_ids[:end]), \
                    (histories, request, end, max_rows)

def test_suffix_proposals_equal_at_a_full_history() -> None:
    """The serving shape: 32k tokens of earlier outputs (older ones evicted), repetitive enough
    that long suffixes match in both sources."""
    rng = random.Random(7)
    phrases = [[rng.randrange(1000) for _ in range(rng.randrange(3, 12))] for _ in range(40)]

    def text(num_tokens: int) -> np.ndarray:
        out: list[int] = []
        while len(out) < num_tokens:
            out += phrases[rng.randrange(len(phrases))] if rng.random() < 0.8 else [rng.randrange(1000)]
        return np.array(out[:num_tokens], dtype=np.int64)

    new, reference = SuffixProposer(8), ReferenceSuffix(8)
    for _ in range(80):
        history = text(rng.randrange(100, 800))
        new.observe_finished(history)
        reference.observe_finished(history)
    assert len(new._shared) == len(reference.shared) > 30_000
    num_proposed = 0
    for _ in range(10):
        request = text(600)
        for end in range(2, len(request) + 1, 7):
            drafts = new.propose(request[:end])
            assert drafts == reference.propose(request[:end])
            num_proposed += bool(drafts)
    assert num_proposed > 100  # the comparison covered real proposals, not only empty ones


@settings(max_examples=400, deadline=None)
@given(tokens.filter(len), st.integers(1, 10), st.integers(1, 4), st.integers(0, 6))
def test_ngram_proposals_equal_the_longest_latest_match(request: list[int], num_tokens: int, min_n: int,
                                                        extra_n: int) -> None:
    proposer = NgramProposer(num_tokens, min_n, min_n + extra_n)
    token_ids = np.array(request, dtype=np.int64)
    for end in range(1, len(token_ids) + 1):
        assert proposer.propose(token_ids[:end]) == reference_ngram(token_ids[:end], num_tokens, min_n,
                                                                    min_n + extra_n)
