"""Prompt lookup (vLLM's `ngram`, llama.cpp's lookup): find the latest earlier occurrence of the
last n tokens, longest n first, and propose the tokens that followed it. Input-grounded work
(quoting, editing a file, answering from a document) repeats long runs of its own context."""
from __future__ import annotations

import numpy as np

from engine.execution.speculative.backward_match import longest_backward_matches
from engine.execution.speculative.proposer import Proposer


class NgramProposer(Proposer):
    method = "ngram"

    def __init__(self, num_tokens: int, min_n: int, max_n: int) -> None:
        self.num_tokens, self.min_n, self.max_n = num_tokens, min_n, max_n

    def propose(self, token_ids: np.ndarray) -> list[int]:
        # ends: [H] every earlier position holding the last token; the matches narrow backwards
        # together, so a step costs one pass over the history and not one per n.
        ends = np.flatnonzero(token_ids[:-1] == token_ids[-1])
        if ends.size == 0:
            return []
        longest, (longest_ends,) = longest_backward_matches([(token_ids, ends)], token_ids,
                                                            min(self.max_n, len(token_ids) - 1))
        if longest < self.min_n:
            return []
        # The latest of the longest matches: the nearest context repeats most.
        start = int(longest_ends[-1]) + 1
        return token_ids[start : start + self.num_tokens].tolist()
