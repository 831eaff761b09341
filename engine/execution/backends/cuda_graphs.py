"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket (as vLLM captures them).

Why: a small decode step on a GPU is dozens of kernel launches per layer, each a few
microseconds of CPU time, so a step of a small model costs its launches, not its work; a graph
replays them all in one launch. Inputs live in static buffers the graph reads; a step copies its
rows into them and pads to the bucket: a padded row has context length 0 (its attention output
is 0) and writes its K/V into a scratch block past the pool, so it touches nobody's cache.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch
from torch import nn

from engine.execution.attention import AttentionMetadata
from engine.execution.backends.triton_attention import TritonAttention

logger = logging.getLogger(__name__)

_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes captured: the ladder up to max_num_seqs, which always has its own."""
    return sorted({b for b in _BUCKETS if b < max_num_seqs} | {max_num_seqs})


def bucket_for(batch: int, buckets: list[int]) -> int:
    """The smallest captured bucket that holds `batch` rows."""
    for bucket in buckets:
        if bucket >= batch:
            return bucket
    raise ValueError(f"batch: {batch} rows, more than the largest captured bucket ({buckets[-1]})")


class DecodeGraphs:
    def __init__(self, model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 max_blocks: int, buckets: list[int], scratch_slot: int, device: torch.device,
                 layer_group: tuple[int, ...] = (0,)) -> None:
        """max_blocks: block-table width (the longest context's blocks); scratch_slot: where
        padded rows write their K/V; layer_group: each layer's KV-cache group."""
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.buckets, self.max_blocks, self.scratch_slot = buckets, max_blocks, scratch_slot
        self.layer_group = tuple(layer_group)
        self.num_groups = num_groups = max(self.layer_group) + 1
        max_batch = buckets[-1]
        # Static inputs: [max_batch] each, [groups, max_batch] slots, [groups, max_batch, max_blocks]
        # tables (slot_mapping and block_tables: group 0's); pinned host twins.
        self.token_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.group_slot_mapping = torch.full((num_groups, max_batch), scratch_slot, dtype=torch.int64, device=device)
        self.context_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.group_block_tables = torch.zeros(num_groups, max_batch, max_blocks, dtype=torch.int32, device=device)
        self.slot_mapping, self.block_tables = self.group_slot_mapping[0], self.group_block_tables[0]
        self._host = torch.zeros((3 + num_groups) * max_batch + num_groups * max_batch * max_blocks, dtype=torch.int64,
                                 pin_memory=device.type == "cuda")  # pinned: the copy in is asynchronous
        self.attention = TritonAttention(max_context_len=max_blocks * block_size)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # bucket -> [bucket, vocab] float32, the graph's output
        self.argmax: dict[int, torch.Tensor] = {}  # bucket -> [bucket] int64
        self._pool = None

    def _forward(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        groups = [AttentionMetadata(slot_mapping=self.group_slot_mapping[g, :batch], block_size=self.block_size,
                                    backend=self.attention, block_tables=self.group_block_tables[g, :batch],
                                    context_lens=self.context_lens[:batch]) for g in range(self.num_groups)]
        attn = groups[0] if self.num_groups == 1 else AttentionMetadata(
            slot_mapping=None, block_size=self.block_size, backend=self.attention, groups=groups,
            layer_group=self.layer_group)
        hidden = self.model(self.token_ids[:batch], self.positions[:batch], attn, self.kv_caches)
        logits = self.model.compute_logits(hidden)  # [batch, vocab] float32
        return logits, logits.argmax(dim=-1)

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per bucket, largest first (the smaller ones reuse its memory pool); each run
        once eagerly first (Triton compiles, lazy tables fill)."""
        start = time.monotonic()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bucket in reversed(self.buckets):
                self._forward(bucket)
        torch.cuda.current_stream().wait_stream(stream)
        for bucket in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self.logits[bucket], self.argmax[bucket] = self._forward(bucket)
            self._pool = graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize()
        logger.info("captured %d decode graphs (batch %s) in %.1f s", len(self.buckets), self.buckets,
                    time.monotonic() - start)

    def step(self, token_ids: list[int], block_tables: list[list[list[int]]], context_lens: list[int],
             with_argmax: bool) -> tuple[torch.Tensor, list[int] | None]:
        """A decode step of len(token_ids) rows (block_tables[group][row]: each row's table in each
        KV-cache group) -> logits [B, vocab] float32 (a view of the graph's output, valid until the
        next step) and, with_argmax, the rows' argmax."""
        batch = len(token_ids)
        bucket = bucket_for(batch, self.buckets)
        bs, width, num_groups = self.block_size, self.max_blocks, self.num_groups
        host = self._host.numpy()
        # Staged as [tokens | positions | lens | slots per group | tables per group], each [bucket] rows.
        tokens, positions, lens = (host[i * bucket:(i + 1) * bucket] for i in range(3))
        slots = host[3 * bucket: (3 + num_groups) * bucket].reshape(num_groups, bucket)
        table_start = (3 + num_groups) * bucket
        tables = host[table_start: table_start + num_groups * bucket * width].reshape(num_groups, bucket, width)
        tokens[:batch], tokens[batch:] = token_ids, 0
        lens[:batch], lens[batch:] = context_lens, 0
        positions[:] = np.maximum(lens - 1, 0)
        tables[:] = 0
        rows = np.arange(batch)
        for group, group_tables in enumerate(block_tables):
            for i, table in enumerate(group_tables):
                tables[group, i, : len(table)] = table
            slots[group, :batch] = tables[group, rows, positions[:batch] // bs] * bs + positions[:batch] % bs
        slots[:, batch:] = self.scratch_slot
        staged = self._host[: table_start + num_groups * bucket * width]
        pinned = staged.to(self.token_ids.device, non_blocking=True)
        self.token_ids[:bucket].copy_(pinned[:bucket])
        self.positions[:bucket].copy_(pinned[bucket: 2 * bucket])
        self.context_lens[:bucket].copy_(pinned[2 * bucket: 3 * bucket])
        self.group_slot_mapping[:, :bucket].copy_(pinned[3 * bucket: table_start].view(num_groups, bucket))
        self.group_block_tables[:, :bucket].copy_(pinned[table_start:].view(num_groups, bucket, width))
        self.graphs[bucket].replay()
        logits = self.logits[bucket][:batch]
        return logits, self.argmax[bucket][:batch].tolist() if with_argmax else None
