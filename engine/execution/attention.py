"""Attention over the paged KV cache, for the two workloads, as the model sees it.

Cache layout per layer: k_cache, v_cache: [num_slots, num_kv_heads, head_dim] where
slot = block_id * block_size + offset. A step's rows are its prefill chunks first, then one
decode token per sequence; new K/V are written at slot_mapping before attention runs. How
attention is computed is the backend's (engine/execution/backends/: torch's reference paths,
the C++ CPU kernels, Triton on CUDA), chosen once: the model calls `attention()`, which hands
the rows to the AttentionBackend the metadata carries.

KV-cache groups (engine/execution/kv_cache_layout.py): layers of different kinds (full attention,
each window size) read their own group's block tables and slots. A step with one group has one
AttentionMetadata; with several, the step's holds one per group (`groups`), and the model hands
layer i `attn.for_layer(i)`. The step's own then carries no slots, so a model that skipped it
fails at once instead of reading another group's blocks.

A layer with a sliding window W lets a query at position i see keys j with i - W < j <= i
(transformers' definition), in every backend.

Sinks (gpt-oss): a layer may pass `sinks` [H], one logit per query head that joins that head's
softmax denominator and no value: probabilities exp(s_j) / (sum_j exp(s_j) + exp(sink)), so the
output is the plain attention output times sigmoid(lse - sink). Every backend takes them; None
(every other family) leaves each kernel's work as it was.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PrefillSeqMeta:
    query_start: int
    query_len: int
    context_len: int  # tokens in the cache after this chunk, including it
    context_slots: torch.Tensor | None  # [context_len] slots; None when nothing was cached
    cached_slot_start: int | None = None  # set when the cached tokens sit in consecutive slots
    block_table: torch.Tensor | None = None  # [num_blocks] int64, for kernels that walk the table

    @property
    def num_cached_tokens(self) -> int:
        return self.context_len - self.query_len


@dataclass(slots=True)
class AttentionMetadata:
    """Rows [0, num_prefill_tokens) of a step are prefill chunks, the rest one decode token each."""

    slot_mapping: torch.Tensor | None  # [num_tokens] where each new token's K/V goes (None: see groups)
    num_prefill_tokens: int = 0
    prefill: list[PrefillSeqMeta] | None = None
    block_size: int = 0
    block_tables: torch.Tensor | None = None  # [B, max_blocks] (decode)
    context_lens: torch.Tensor | None = None  # [B] (decode)
    backend: AttentionBackend | None = None  # who computes it (set by the runner from its backend)
    decode_slots: torch.Tensor | None = None  # [B, L] context slots (torch's gathered decode)
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, L] additive: 0 or -inf (torch's gathered decode)
    is_fused: bool = False  # a step small enough for the CPU backend's fused C++ layers
    # Packed-chunk layout for kernels that take a step's chunks in one launch (Triton):
    query_start_loc: torch.Tensor | None = None  # [num_chunks + 1] int32
    seq_lens: torch.Tensor | None = None  # [num_chunks] int32: context after each chunk
    prefill_block_tables: torch.Tensor | None = None  # [num_chunks, max_blocks] int32
    max_query_len: int = 0
    # Several KV-cache groups: each group's metadata, and each layer's group.
    groups: list[AttentionMetadata] | None = None
    layer_group: tuple[int, ...] = ()

    def for_layer(self, layer: int) -> AttentionMetadata:
        """What layer `layer` reads: its KV-cache group's metadata (this one with one group)."""
        return self if self.groups is None else self.groups[self.layer_group[layer]]


class AttentionBackend:
    """Attention for one backend: prefill() over the chunks, decode() over one token per row.
    forward() splits a step's rows between them (prefill rows first)."""

    #: Whether prefill chunks need their block tables (kernels that walk the cache) rather than
    #: the cached context's slots (torch's path).
    reads_prefill_block_tables = False
    #: Whether bidirectional() runs (an encoder's attention over its packed prompts); else the
    #: encoder pads its prompts into one SDPA call.
    has_bidirectional_kernel = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, attn: AttentionMetadata, scale: float, window: int | None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] (already in the cache); sinks: [H] or None -> [T, H, D] in q's dtype."""
        num_prefill = attn.num_prefill_tokens
        if num_prefill == q.shape[0]:
            return self.prefill(q, k, v, k_cache, v_cache, attn, scale, window, sinks)
        if num_prefill == 0:
            return self.decode(q, k_cache, v_cache, attn, scale, window, sinks)
        out = torch.empty_like(q)
        out[:num_prefill] = self.prefill(q[:num_prefill], k[:num_prefill], v[:num_prefill], k_cache, v_cache,
                                         attn, scale, window, sinks)
        out[num_prefill:] = self.decode(q[num_prefill:], k_cache, v_cache, attn, scale, window, sinks)
        return out

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, attn: AttentionMetadata, scale: float, window: int | None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionMetadata,
               scale: float, window: int | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def bidirectional(self, qkv: torch.Tensor, query_starts: torch.Tensor, num_heads: int,
                      scale: float) -> torch.Tensor:
        """An encoder step's attention by the backend's own kernel (has_bidirectional_kernel).
        qkv: [T, 3 * H * D], each row q | k | v; query_starts: [B + 1] int64 on the CPU, prompt
        b's rows [starts[b], starts[b + 1]) -> [T, H, D] in qkv's dtype: each prompt's tokens
        attend to all of its own, none of another's."""
        raise NotImplementedError

    def prepare_prefill(self, attn: AttentionMetadata, block_tables: list[list[int]], num_computed: list[int],
                        num_new_tokens: list[int]) -> None:
        """Fill what prefill() needs beyond the per-chunk metas (kernels that take every chunk of
        a step in one launch): each chunk's block table, cached tokens and new tokens."""

    def prepare_decode(self, attn: AttentionMetadata, block_tables: torch.Tensor, context_lens: torch.Tensor) -> None:
        """Fill what decode() needs from the step's [B, max_blocks] tables and [B] lengths."""
        attn.block_tables, attn.context_lens = block_tables, context_lens


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    # k, v: [num_tokens, num_kv_heads, head_dim], rounded to the cache's dtype where it differs
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              attn: AttentionMetadata, scale: float, window: int | None = None,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Both paths of one step, by the step's attention backend. q: [T, H, D]; sinks: [H] or None -> [T, H, D]."""
    return attn.backend.forward(q, k, v, k_cache, v_cache, attn, scale, window, sinks)
