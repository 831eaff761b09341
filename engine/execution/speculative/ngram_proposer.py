"""Prompt lookup (vLLM's `ngram`, llama.cpp's lookup): find the latest earlier occurrence of the
last n tokens, longest n first, and propose the tokens that followed it. Input-grounded work
(quoting, editing a file, answering from a document) repeats long runs of its own context."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.execution.speculative.proposer import Proposer


class NgramProposer(Proposer):
    method = "ngram"

    def __init__(self, num_tokens: int, min_n: int, max_n: int) -> None:
        self.num_tokens, self.min_n, self.max_n = num_tokens, min_n, max_n

    def propose(self, token_ids: np.ndarray) -> list[int]:
        length = len(token_ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = token_ids[-n:]
            # Every n-gram that starts before the suffix's own position: [length - n, n] views.
            windows = sliding_window_view(token_ids[:-1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the latest match: the nearest context repeats most
                return token_ids[start : start + self.num_tokens].tolist()
        return []
