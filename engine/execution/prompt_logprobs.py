"""Logprobs of the prompt's own tokens (vLLM's prompt_logprobs), from a prefill step's hidden states."""
from __future__ import annotations

from typing import Any

import torch

from engine.core.scheduler_output import SchedulerOutput
from engine.execution.input_batch import CachedRequestState, PrefillInputs

_PROMPT_LOGPROB_ROWS = 256  # prompt positions scored per logits slice

Logprobs = dict[int, float]


def prompt_logprobs(model: Any, sched: SchedulerOutput, rows: list[CachedRequestState], prefill: PrefillInputs,
                    hidden: torch.Tensor) -> list[tuple[str, int, list[Logprobs]]]:
    """(request, first prompt position, entries) for the step's prefill chunks that asked for
    prompt logprobs: entry k scores prompt token first + k (from position first + k - 1), with
    that token's logprob and the top-N. Logits are made a slice of rows at a time, never for a
    whole long prompt at once ([rows, vocab] float32 is large for a long prompt).
    hidden: [T, hidden] of the step, the chunks first."""
    results = []
    for row, start, n, meta in zip(rows, sched.prefill_num_computed, sched.prefill_num_tokens, prefill.metas,
                                   strict=True):
        top_n = row.params.prompt_logprobs
        if top_n is None:
            continue
        # This chunk covers positions [start, start + n); the prompt's last position scores no prompt token.
        first_row, last_pos = meta.query_start, min(start + n, row.num_prompt_tokens - 1)
        entries: list[Logprobs] = []
        for lo in range(start, last_pos, _PROMPT_LOGPROB_ROWS):
            hi = min(lo + _PROMPT_LOGPROB_ROWS, last_pos)
            logprobs = torch.log_softmax(model.compute_logits(
                hidden[first_row + lo - start : first_row + hi - start]).float(), dim=-1)  # [rows, vocab]
            targets = torch.tensor(row.prompt_token_ids[lo + 1 : hi + 1], device=logprobs.device)
            chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
            top = logprobs.topk(top_n, dim=-1) if top_n else None
            top_ids = top.indices.tolist() if top is not None else [[]] * len(chosen)
            top_values = top.values.tolist() if top is not None else [[]] * len(chosen)
            for target, value, ids, values in zip(targets.tolist(), chosen, top_ids, top_values, strict=True):
                entry = {target: value}
                for token_id, v in zip(ids, values, strict=True):
                    entry.setdefault(token_id, v)
                entries.append(entry)
        results.append((row.req_id, start + 1, entries))
    return results
