"""A request's tokens as one growing numpy array, for the proposers: appended to as the request
emits, not rebuilt from its token lists every step (at a long context that copy was most of a
proposal's cost)."""
from __future__ import annotations

import numpy as np


class TokenHistory:
    def __init__(self, prompt_token_ids: list[int]) -> None:
        self._num_prompt_tokens = len(prompt_token_ids)
        self._tokens = np.empty(max(16, 2 * self._num_prompt_tokens), dtype=np.int64)  # [capacity]
        self._tokens[: self._num_prompt_tokens] = prompt_token_ids
        self._length = self._num_prompt_tokens

    def view(self, output_token_ids: list[int]) -> np.ndarray:
        """The prompt and output_token_ids (which only grow) as [L] int64; a view, valid until
        the next call."""
        new = output_token_ids[self._length - self._num_prompt_tokens :]
        end = self._length + len(new)
        if end > len(self._tokens):
            grown = np.empty(2 * end, dtype=np.int64)
            grown[: self._length] = self._tokens[: self._length]
            self._tokens = grown
        self._tokens[self._length : end] = new
        self._length = end
        return self._tokens[:end]
