"""Attention over the paged KV cache, for the two workloads.

Cache layout per layer: k_cache, v_cache: [num_slots, num_kv_heads, head_dim] where
slot = block_id * block_size + offset. New K/V are written at slot_mapping first; then
- prefill: per sequence, causal attention of its chunk over its whole context. A sequence
  with nothing cached attends over the fresh K/V directly; one with a cached prefix (prefix
  hit, later chunk, recompute) gathers its context from the cache.
- decode: one query per sequence. On the CPU (fp32 or bf16) a C++ kernel walks each block
  table directly (engine/kernels); otherwise all contexts are gathered at once through a
  [B, L] slot index shared by every layer, padded positions masked out.
A layer with a sliding window W lets a query at position i see keys j with i - W < j <= i
(transformers' definition), in both paths.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSeqMeta:
    query_start: int
    query_len: int
    context_len: int  # tokens in the cache after this chunk, including it
    context_slots: torch.Tensor | None  # [context_len] slots; None when nothing was cached


@dataclass(slots=True)
class AttentionMetadata:
    """Rows [0, num_prefill_tokens) of a step are prefill chunks, the rest one decode token each."""

    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V goes
    num_prefill_tokens: int = 0
    prefill: list[PrefillSeqMeta] | None = None
    block_size: int = 0
    block_tables: torch.Tensor | None = None  # [B, max_blocks] (decode)
    context_lens: torch.Tensor | None = None  # [B] (decode)
    decode_kernels: ModuleType | None = None  # C++ kernels, when usable
    decode_slots: torch.Tensor | None = None  # [B, L] context slots (torch decode path)
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, L] additive: 0 or -inf (torch decode path)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    # k, v: [num_tokens, num_kv_heads, head_dim]
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              attn: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
    """Both paths of one step: prefill rows first, then decode rows. q: [T, H, D] -> [T, H, D]."""
    num_prefill = attn.num_prefill_tokens
    if num_prefill == q.shape[0]:
        return prefill_attention(q, k, v, k_cache, v_cache, attn.prefill, scale, window)
    if num_prefill == 0:
        return decode_attention(q, k_cache, v_cache, attn, scale, window)
    out = torch.empty_like(q)
    out[:num_prefill] = prefill_attention(q[:num_prefill], k[:num_prefill], v[:num_prefill], k_cache, v_cache,
                                          attn.prefill, scale, window)
    out[num_prefill:] = decode_attention(q[num_prefill:], k_cache, v_cache, attn, scale, window)
    return out


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, seqs: list[PrefillSeqMeta], scale: float,
                      window: int | None = None) -> torch.Tensor:
    # q: [T, H, D]; k, v: [T, KVH, D] -> out: [T, H, D]
    out = torch.empty_like(q)
    for meta in seqs:
        q_i = q[meta.query_start : meta.query_start + meta.query_len].transpose(0, 1)  # [H, n, D]
        is_windowed = window is not None and meta.context_len > window
        if meta.context_slots is None and not is_windowed:
            k_i = k[meta.query_start : meta.query_start + meta.query_len].transpose(0, 1)
            v_i = v[meta.query_start : meta.query_start + meta.query_len].transpose(0, 1)
            o_i = F.scaled_dot_product_attention(q_i, k_i, v_i, is_causal=True, scale=scale, enable_gqa=True)
        else:
            if meta.context_slots is None:  # fresh prompt, but a window narrower than it
                k_i = k[meta.query_start : meta.query_start + meta.query_len].transpose(0, 1)
                v_i = v[meta.query_start : meta.query_start + meta.query_len].transpose(0, 1)
            else:
                k_i = k_cache.index_select(0, meta.context_slots).transpose(0, 1)  # [KVH, ctx, D]
                v_i = v_cache.index_select(0, meta.context_slots).transpose(0, 1)
            offset = meta.context_len - meta.query_len
            rows = torch.arange(meta.query_len, device=q.device).unsqueeze(1) + offset
            cols = torch.arange(meta.context_len, device=q.device).unsqueeze(0)
            mask = cols <= rows
            if is_windowed:
                mask &= cols > rows - window
            o_i = F.scaled_dot_product_attention(q_i, k_i, v_i, attn_mask=mask, scale=scale, enable_gqa=True)
        out[meta.query_start : meta.query_start + meta.query_len] = o_i.transpose(0, 1)
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionMetadata,
                     scale: float, window: int | None = None) -> torch.Tensor:
    # q: [B, H, D] -> out: [B, H, D]
    if attn.decode_kernels is not None:
        return attn.decode_kernels.paged_decode_attention(q, k_cache, v_cache, attn.block_tables,
                                                          attn.context_lens, attn.block_size, scale, window or 0)
    mask = attn.decode_mask
    if window is not None:
        # Keys before context_len - window fall out of the window: [B, 1, 1, L]
        cols = torch.arange(mask.shape[-1], device=mask.device)
        outside = cols.unsqueeze(0) < (attn.context_lens - window).unsqueeze(1)
        mask = mask.masked_fill(outside.view(mask.shape), float("-inf"))
    return gathered_decode_attention(q, k_cache, v_cache, attn.decode_slots, mask, scale)


def gathered_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                              mask: torch.Tensor, scale: float) -> torch.Tensor:
    # q: [B, H, D]; slots: [B, L]; mask: [B, 1, 1, L] -> out: [B, H, D]
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    # GQA without repeating K/V: the `group` query heads of one KV head share a matmul.
    k = k_cache[slots].permute(0, 2, 3, 1)  # [B, KVH, D, L]
    v = v_cache[slots].transpose(1, 2)  # [B, KVH, L, D]
    q = q.view(batch, num_kv_heads, group, head_dim)
    scores = torch.matmul(q, k) * scale + mask  # [B, KVH, G, L]
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v).view(batch, num_heads, head_dim)
