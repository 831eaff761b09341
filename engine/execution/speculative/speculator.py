"""The runner's side of speculative decoding: it verifies a step's proposals (each position's
grammar mask, then Sampler.verify's exact accept / reject) and makes the next step's proposals.

It adapts per request, so speculation never costs a stream its pace: a verification costs more
the more drafts it carries (each is a row of the step's GEMMs), so after a rejection a request
proposes only one more token than it had accepted, and doubles again (to k) while everything is
accepted; two verifications in a row that accept nothing pause its proposals, for a while that
doubles while they keep failing (free prose, where an n-gram's continuation is chance)."""
from __future__ import annotations

import numpy as np
import torch

from engine.execution.input_batch import CachedRequestState
from engine.execution.sampler import Logprobs, Sampler, accepted_run
from engine.execution.speculative.proposer import Proposer
from engine.execution.speculative.token_history import TokenHistory
from engine.processing.structured_output import GrammarMask

_MISSES_BEFORE_PAUSE = 2  # verifications in a row that accepted nothing
_FIRST_PAUSE_STEPS = 4
_MAX_PAUSE_STEPS = 64


class Speculator:
    def __init__(self, proposer: Proposer, sampler: Sampler, max_batch: int, num_tokens: int) -> None:
        self.proposer, self.sampler, self.max_batch = proposer, sampler, max_batch
        self.num_tokens = num_tokens  # k
        self.method = proposer.method
        self._histories: dict[str, TokenHistory] = {}  # by request id, while it is in the batch

    def verify(self, logits: torch.Tensor, rows: list[CachedRequestState], drafts: list[list[int]], step: int
               ) -> tuple[list[list[int]], list[list[Logprobs] | None]]:
        """logits: [sum(1 + len(d)), vocab], each request's rows consecutive (its last token's,
        then each draft's) -> per request its accepted drafts and the token after them."""
        views, chunks = [], []
        # Logprobs are the model's, before any grammar's mask, as the plain path reports them.
        raw_logprobs = torch.log_softmax(logits, dim=-1) \
            if any(row.params.logprobs is not None for row in rows) else None
        for row, request_drafts in zip(rows, drafts, strict=True):
            first = len(views)
            chunks.append((first, request_drafts))
            views += [row.with_drafts(request_drafts[:j]) for j in range(len(request_drafts) + 1)]
            if row.matcher is not None:
                self._grammar_mask(logits).apply_along(logits, first, row.matcher, request_drafts)
        tokens, logprobs = self.sampler.verify(logits, views, chunks, raw_logprobs)
        for row, request_drafts, accepted in zip(rows, drafts, tokens, strict=True):
            self._record(row, len(request_drafts), len(accepted) - 1, step)
        return tokens, logprobs

    def accept_greedy(self, greedy_ids: list[int], rows: list[CachedRequestState], drafts: list[list[int]],
                      step: int) -> list[list[int]]:
        """verify() for plain greedy requests, from each verified row's argmax (the forward's):
        a draft is kept while it equals its row's argmax, then the argmax after the last kept."""
        tokens, first = [], 0
        for row, request_drafts in zip(rows, drafts, strict=True):
            tokens.append(accepted_run(request_drafts, greedy_ids, first))
            self._record(row, len(request_drafts), len(tokens[-1]) - 1, step)
            first += 1 + len(request_drafts)
        return tokens

    def propose(self, rows: list[CachedRequestState], step: int) -> dict[str, list[int]]:
        """The next step's proposals, for the requests just sampled (they decode next), unless the
        batch is past the size speculation pays at, or a request is paused."""
        if len(rows) > self.max_batch:
            return {}
        proposals = {}
        for row in rows:
            if step < row.spec_paused_until:
                continue
            history = self._histories.get(row.req_id)
            if history is None:
                history = self._histories[row.req_id] = TokenHistory(row.prompt_token_ids)
            drafts = self.proposer.propose(history.view(row.output_token_ids))
            if drafts:
                proposals[row.req_id] = drafts[: row.spec_len or self.num_tokens]
        return proposals

    def remove(self, row: CachedRequestState, is_preempted: bool) -> None:
        """A request left the batch: finished or aborted, its output is history proposers may
        learn from; preempted, it comes back with the same tokens and goes on, so not yet."""
        self._histories.pop(row.req_id, None)
        if not is_preempted:
            self.proposer.observe_finished(np.asarray(row.output_token_ids, dtype=np.int64))

    @staticmethod
    def _record(row: CachedRequestState, num_drafts: int, num_accepted: int, step: int) -> None:
        if num_accepted == num_drafts:
            row.spec_len = 2 * num_drafts
        else:
            row.spec_len = num_accepted + 1
        if num_accepted:
            row.spec_misses, row.spec_pause = 0, _FIRST_PAUSE_STEPS
            return
        row.spec_misses += 1
        if row.spec_misses >= _MISSES_BEFORE_PAUSE:
            row.spec_paused_until = step + row.spec_pause
            row.spec_pause = min(2 * row.spec_pause, _MAX_PAUSE_STEPS)
            row.spec_misses = 0

    def _grammar_mask(self, logits: torch.Tensor) -> GrammarMask:
        if self.sampler.grammar_mask is None:
            self.sampler.grammar_mask = GrammarMask(logits.shape[1], 64, self.sampler.kernels)
        return self.sampler.grammar_mask
