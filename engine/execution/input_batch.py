"""The runner's persistent batch: one row per request it runs, kept across steps and updated from
each SchedulerOutput's diffs (rows added, block tables changed, rows removed) instead of rebuilt
from the scheduler's sequences, and the step inputs built from those rows (vLLM v1's
InputBatch, in plain Python lists: the fused CPU decode takes them as they are).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.core.scheduler_output import SchedulerOutput
from engine.execution.attention import PrefillSeqMeta
from engine.processing.pooling_params import PoolingParams
from engine.processing.request_tokens import RequestTokens
from engine.processing.sampling_params import SamplingParams


@dataclass(slots=True, eq=False)
class CachedRequestState(RequestTokens):
    """A request as the runner sees it: its tokens, blocks and sampling state. The sampler reads
    rows like this one (params, token lists, generator, matcher, min_tokens_stop_ids)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # the runner's own: it appends what it samples
    block_tables: list[list[int]]  # one per KV-cache group (engine/execution/kv_cache_layout.py)
    params: SamplingParams
    generator: torch.Generator | None
    matcher: Any
    min_tokens_stop_ids: frozenset[int]
    # Speculative decoding (speculator.py): how many drafts it proposes next (0: k), its
    # verifications in a row that accepted nothing, and when its proposals pause and for how long.
    spec_len: int = 0
    spec_misses: int = 0
    spec_paused_until: int = -1
    spec_pause: int = 4
    # A pooling request (resolved params) and what its chunks have pooled so far (mean: the sum of
    # their hidden states; cls: the first token's), [hidden] float32.
    pooling_params: PoolingParams | None = None
    pooled: torch.Tensor | None = None
    token_type_ids: np.ndarray | None = None  # [num_prompt_tokens] int64, for a model that reads them

    def with_drafts(self, drafts: list[int]) -> DraftView:
        """As the sampler sees this request at a verified position: drafts counted as output."""
        return DraftView(self, drafts)


@dataclass(slots=True)
class DraftView:
    """A request at one position of a verification, for the sampler: its row with `drafts`
    counted as output. The output list is built only when read (penalties): a verification
    makes k + 1 views, and copying a long output into each cost O(k * length) a step. Its
    grammar's mask is applied by the runner, position by position, so no matcher here."""

    row: CachedRequestState
    drafts: list[int]
    matcher: Any = None

    @property
    def params(self) -> SamplingParams:
        return self.row.params

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.row.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.row.output_token_ids + self.drafts

    @property
    def generator(self) -> torch.Generator | None:
        return self.row.generator

    @property
    def min_tokens_stop_ids(self) -> frozenset[int]:
        return self.row.min_tokens_stop_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.row.output_token_ids) + len(self.drafts)


@dataclass(slots=True)
class Chunk:
    """Tokens of one sequence the step computes: token_ids at positions start.. of its tables."""

    token_ids: list[int]
    start: int
    block_tables: list[list[int]]  # one per KV-cache group


class InputBatch:
    def __init__(self) -> None:
        self.rows: dict[str, CachedRequestState] = {}

    def update(self, sched: SchedulerOutput) -> None:
        """Apply the step's diffs: removals first (a request preempted and resumed in one step
        is both removed and added)."""
        for req_id in sched.removed_req_ids:
            self.rows.pop(req_id, None)
        for new in sched.new_requests:
            self.rows[new.req_id] = CachedRequestState(
                new.req_id, new.prompt_token_ids, new.output_token_ids, [list(t) for t in new.block_ids], new.params,
                new.generator, new.matcher, new.min_tokens_stop_ids, pooling_params=new.pooling_params,
                token_type_ids=new.token_type_ids)
        for req_id, (start, block_ids) in sched.block_table_updates.items():
            for table, tail in zip(self.rows[req_id].block_tables, block_ids, strict=True):
                del table[start:]
                table.extend(tail)

    def append_sampled(self, req_ids: list[str], token_ids: list[list[int]]) -> None:
        for req_id, tokens in zip(req_ids, token_ids, strict=True):
            self.rows[req_id].output_token_ids.extend(tokens)


@dataclass(slots=True)
class PrefillInputs:
    token_ids: np.ndarray  # [T_prefill]
    positions: np.ndarray  # [T_prefill]
    slot_mapping: np.ndarray  # [T_prefill]
    metas: list[PrefillSeqMeta]
    last_indices: list[int]  # each chunk's last row

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class DecodeInputs:
    token_ids: np.ndarray  # [B]
    positions: np.ndarray  # [B]
    slot_mapping: np.ndarray  # [B]
    block_tables: np.ndarray  # [B, max_blocks]
    context_lens: np.ndarray  # [B]


def prepare_prefill(chunks: list[Chunk], block_size: int, to_device: Any, with_block_tables: bool,
                    group: int = 0) -> PrefillInputs | None:
    """The packed chunks' inputs (prompt chunks, and the verifications of proposed tokens) by the
    tables of KV-cache group `group`. with_block_tables: the C++ prefill kernel reads the cache by
    block table; otherwise torch's path reads a cached context by slot (in place when its slots
    are consecutive)."""
    if not chunks:
        return None
    bs = block_size
    token_ids: list[int] = []
    positions, slots, metas, last_indices = [], [], [], []
    num_tokens = 0
    for chunk in chunks:
        start, n = chunk.start, len(chunk.token_ids)
        token_ids.extend(chunk.token_ids)
        table = np.asarray(chunk.block_tables[group], dtype=np.int64)
        # By block table, only the chunk's own slots: a verification of a few tokens at a long
        # context would otherwise map the whole context every step.
        ctx_pos = np.arange(start if with_block_tables else 0, start + n, dtype=np.int64)
        ctx_slots = table[ctx_pos // bs] * bs + ctx_pos % bs
        first = len(ctx_pos) - n
        positions.append(ctx_pos[first:])
        slots.append(ctx_slots[first:])
        meta = PrefillSeqMeta(num_tokens, n, start + n, None)
        if with_block_tables:
            meta.block_table = to_device(table)
        elif start:
            meta.context_slots = to_device(ctx_slots)
            slot0 = int(ctx_slots[0])
            if np.array_equal(ctx_slots[:start], np.arange(slot0, slot0 + start)):  # read the pool in place
                meta.cached_slot_start = slot0
        metas.append(meta)
        num_tokens += n
        last_indices.append(num_tokens - 1)
    return PrefillInputs(np.asarray(token_ids, dtype=np.int64), np.concatenate(positions), np.concatenate(slots),
                         metas, last_indices)


def prepare_decode(rows: list[CachedRequestState], block_size: int, group: int = 0) -> DecodeInputs | None:
    """One token per row, by the tables of KV-cache group `group`."""
    if not rows:
        return None
    bs = block_size
    batch = len(rows)
    max_blocks = max(len(r.block_tables[group]) for r in rows)
    tables = np.zeros((batch, max_blocks), dtype=np.int64)  # padding reads block 0, masked
    for i, row in enumerate(rows):
        table = row.block_tables[group]
        tables[i, : len(table)] = table
    context_lens = np.fromiter((r.num_tokens for r in rows), dtype=np.int64, count=batch)
    positions = context_lens - 1
    slot_mapping = tables[np.arange(batch), positions // bs] * bs + positions % bs
    token_ids = np.fromiter((r.last_token_id for r in rows), dtype=np.int64, count=batch)
    return DecodeInputs(token_ids, positions, slot_mapping, tables, context_lens)
