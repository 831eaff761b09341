"""Prompt lookup (vLLM's `ngram`, llama.cpp's lookup): find the latest earlier occurrence of the
last n tokens, longest n first, and propose the tokens that followed it. Input-grounded work
(quoting, editing a file, answering from a document) repeats long runs of its own context."""
from __future__ import annotations

import numpy as np

from engine.execution.speculative.proposer import Proposer


class NgramProposer(Proposer):
    method = "ngram"

    def __init__(self, num_tokens: int, min_n: int, max_n: int) -> None:
        self.num_tokens, self.min_n, self.max_n = num_tokens, min_n, max_n

    def propose(self, token_ids: np.ndarray) -> list[int]:
        length = len(token_ids)
        # ends: [H] every earlier position holding the last token, each a match of length 1;
        # the matches grow backwards together (one vectorised comparison per extra token), so a
        # step costs one pass over the history and not one per n.
        ends = np.flatnonzero(token_ids[:-1] == token_ids[-1])
        if ends.size == 0:
            return []
        matched = np.ones(ends.size, dtype=np.int64)  # [H]
        alive = np.ones(ends.size, dtype=bool)  # [H]: still matching at this depth
        for depth in range(1, min(self.max_n, length - 1)):
            before = ends - depth
            alive &= before >= 0
            alive[alive] = token_ids[before[alive]] == token_ids[-1 - depth]
            if not alive.any():
                break
            matched += alive
        longest = int(matched.max())
        if longest < self.min_n:
            return []
        # The latest of the longest matches: the nearest context repeats most.
        start = int(ends[np.flatnonzero(matched == longest)[-1]]) + 1
        return token_ids[start : start + self.num_tokens].tolist()
