"""What a proposer is: the next tokens it guesses for a request, from that request's tokens."""
from __future__ import annotations

import numpy as np


class Proposer:
    #: The name metrics and stats carry (the speculative_method).
    method = "none"

    def propose(self, token_ids: np.ndarray) -> list[int]:
        """token_ids: [L] int64, the request's prompt and output so far -> up to k guesses of the
        tokens that follow ([] for none)."""
        raise NotImplementedError

    def observe_finished(self, token_ids: np.ndarray) -> None:
        """A request's tokens once it has left the batch (proposers that learn across requests)."""

    def reset(self) -> None:
        """Forget what earlier requests taught (proposers that learn across requests)."""
