"""Pooling: a step's prefill hidden states -> the outputs of the pooling requests whose prompt
ends in it: an embed request's vector, a score request's score-head logits.

A pooling request's chunks run through the model like any prompt's; the final-normed hidden
states of its tokens are folded into its row as each chunk finishes (mean: their sum; CLS: the
first token's), so a prompt chunked over several steps pools exactly as one forward would, and
its last chunk yields the vector (last-token pooling reads that chunk's last row). A preempted
request's row is dropped and rebuilt, so its sum starts again with its recompute. The step's score
requests go through the model's score head together, in one call.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.core.scheduler_output import SchedulerOutput
from engine.execution.attention import PrefillSeqMeta
from engine.execution.input_batch import CachedRequestState
from engine.processing.pooling_params import PoolingParams, PoolingTask, PoolingType

ScoreHead = Callable[[torch.Tensor], torch.Tensor]  # pooled states [n, hidden] -> raw logits [n, num_labels] float32


def pool_prefill(sched: SchedulerOutput, rows: list[CachedRequestState], metas: list[PrefillSeqMeta],
                 hidden: torch.Tensor, score_head: ScoreHead | None = None) -> tuple[list[str], list[list[float]]]:
    """rows, metas: the step's prefill chunks in `sched.prefill_req_ids` order; hidden: [T, hidden]
    the step's final-normed hidden states; score_head: the model's (a step with score requests
    needs one). Returns the ids of the pooling requests whose prompt ended this step (in prefill
    order) and their outputs: an embed request's finished vector, a score request's logits."""
    req_ids: list[str] = []
    vectors: list[torch.Tensor | None] = []
    score_indices: list[int] = []  # where the score requests' outputs go in `vectors`
    score_states: list[torch.Tensor] = []  # their pooled states, [hidden] each
    for i, (row, meta) in enumerate(zip(rows, metas, strict=False)):
        params = row.pooling_params
        if params is None:
            continue
        states = hidden[meta.query_start : meta.query_start + meta.query_len]  # [chunk, hidden]
        is_first = sched.prefill_num_computed[i] == 0
        if params.pooling_type is PoolingType.MEAN:
            chunk_sum = states.sum(dim=0, dtype=torch.float32)  # [hidden]
            row.pooled = chunk_sum if is_first else row.pooled + chunk_sum
        elif params.pooling_type is PoolingType.CLS and is_first:
            row.pooled = states[0].float()
        if not sched.prefill_is_last_chunk[i]:
            continue
        if params.pooling_type is PoolingType.LAST:
            vector = states[-1].float()
        elif params.pooling_type is PoolingType.MEAN:
            vector = row.pooled / row.num_prompt_tokens
        else:
            vector = row.pooled
        req_ids.append(row.req_id)
        if params.task is PoolingTask.SCORE:
            score_indices.append(len(vectors))
            score_states.append(vector)
            vectors.append(None)
        else:
            vectors.append(finish_vector(vector, params))
    if not vectors:
        return [], []
    if score_states:
        scores = score_head(torch.stack(score_states).to(hidden.dtype)).float()  # [n, num_labels]
        for index, row_scores in zip(score_indices, scores, strict=True):
            vectors[index] = row_scores
    # one copy to the host for the step's outputs (a device sync each, apart)
    host = torch.cat(vectors).cpu().split([len(v) for v in vectors])
    return req_ids, [v.tolist() for v in host]


def finish_vector(vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """Matryoshka truncation to params.dimensions, then L2 normalisation when asked (after the
    cut, so a truncated vector is a unit vector too). vector: [hidden] float32."""
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = F.normalize(vector, p=2.0, dim=-1)
    return vector
