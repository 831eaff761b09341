"""Attention by the Triton kernels (engine/execution/triton): every chunk of a step in one prefill
launch over the packed rows, and split-K decode, both walking the engine's block tables in place.
The CUDA backend's; the kernels need only host ints for their grids, so a decode step can be
captured in a CUDA graph."""
from __future__ import annotations

import torch

from engine.execution import triton as kernels
from engine.execution.attention import AttentionBackend, AttentionMetadata


class TritonAttention(AttentionBackend):
    def __init__(self, max_context_len: int | None = None) -> None:
        """max_context_len: a bound on every decode context (fixes the decode grid: a captured
        graph's); None: each step's own table width."""
        self.max_context_len = max_context_len

    def prepare_prefill(self, attn: AttentionMetadata, block_tables: list[list[int]], num_computed: list[int],
                        num_new_tokens: list[int]) -> None:
        """The chunks as one launch takes them: row offsets, context lengths, padded tables."""
        device = attn.slot_mapping.device
        starts = [0]
        for n in num_new_tokens:
            starts.append(starts[-1] + n)
        width = max(len(t) for t in block_tables)
        tables = torch.zeros(len(block_tables), width, dtype=torch.int32)  # [chunks, max_blocks]; padding unread
        for i, table in enumerate(block_tables):
            tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        attn.query_start_loc = torch.tensor(starts, dtype=torch.int32).to(device, non_blocking=True)
        attn.seq_lens = torch.tensor([c + n for c, n in zip(num_computed, num_new_tokens, strict=True)],
                                     dtype=torch.int32).to(device, non_blocking=True)
        attn.prefill_block_tables = tables.to(device, non_blocking=True)
        attn.max_query_len = max(num_new_tokens)

    def prepare_decode(self, attn: AttentionMetadata, block_tables: torch.Tensor, context_lens: torch.Tensor) -> None:
        attn.block_tables, attn.context_lens = block_tables.to(torch.int32), context_lens.to(torch.int32)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, attn: AttentionMetadata, scale: float, window: int | None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        # q: [T, H, D]; sinks: [H] or None -> [T, H, D] in q's dtype; k, v are in the cache already
        out = torch.empty_like(q)
        return kernels.prefill_attention(q, k_cache, v_cache, attn.prefill_block_tables, attn.query_start_loc,
                                         attn.seq_lens, attn.block_size, scale, window or 0, out,
                                         max_query_len=attn.max_query_len, sinks=sinks)

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionMetadata,
               scale: float, window: int | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        # q: [B, H, D]; sinks: [H] or None -> [B, H, D] in q's dtype
        out = torch.empty_like(q)
        return kernels.decode_attention(q, k_cache, v_cache, attn.block_tables, attn.context_lens, attn.block_size,
                                        scale, window or 0, out, max_context_len=self.max_context_len, sinks=sinks)
