"""Attention over the paged KV cache, for the two workloads.

Cache layout per layer: k_cache, v_cache: [num_slots, num_kv_heads, head_dim] where
slot = block_id * block_size + offset. New K/V are written at slot_mapping first; then
- prefill: per sequence, causal attention of its chunk over its whole context. On an AVX-512
  CPU a C++ flash-style kernel reads every key straight from the paged cache through the block
  table (engine/execution/kernels/prefill_attention.cpp). Otherwise a sequence with nothing cached
  attends over the fresh K/V directly; one with a cached prefix (prefix hit, later chunk,
  recompute) attends to the cache and to itself separately, merged by log-sum-exp (no mask);
  the cache is read in place when its slots are consecutive.
- decode: one query per sequence. On the CPU (fp32 or bf16) a C++ kernel walks each block
  table directly (engine/execution/kernels); otherwise all contexts are gathered at once through a
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
    cached_slot_start: int | None = None  # set when the cached tokens sit in consecutive slots
    block_table: torch.Tensor | None = None  # [num_blocks] int64, for the C++ prefill kernel

    @property
    def num_cached_tokens(self) -> int:
        return self.context_len - self.query_len


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
    prefill_kernels: ModuleType | None = None  # C++ kernels, when their prefill attention is the faster path
    kernel_isa: int = 0  # the SIMD path the C++ attention kernels run
    decode_slots: torch.Tensor | None = None  # [B, L] context slots (torch decode path)
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, L] additive: 0 or -inf (torch decode path)
    is_fused: bool = False  # a step small enough for the model's C++ layers (forward_fused)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    # k, v: [num_tokens, num_kv_heads, head_dim], rounded to the cache's dtype where it differs
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              attn: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
    """Both paths of one step: prefill rows first, then decode rows. q: [T, H, D] -> [T, H, D]."""
    num_prefill = attn.num_prefill_tokens
    if num_prefill == q.shape[0]:
        return prefill_attention(q, k, v, k_cache, v_cache, attn, scale, window)
    if num_prefill == 0:
        return decode_attention(q, k_cache, v_cache, attn, scale, window)
    out = torch.empty_like(q)
    out[:num_prefill] = prefill_attention(q[:num_prefill], k[:num_prefill], v[:num_prefill], k_cache, v_cache,
                                          attn, scale, window)
    out[num_prefill:] = decode_attention(q[num_prefill:], k_cache, v_cache, attn, scale, window)
    return out


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, attn: AttentionMetadata, scale: float,
                      window: int | None = None) -> torch.Tensor:
    """Every chunk of the step, its own K/V already in the cache. q: [T, H, D]; k, v: [T, KVH, D]
    -> [T, H, D] in q's dtype (the math in the cache's dtype, or float32 in the C++ kernel)."""
    if attn.prefill_kernels is not None:
        return _kernel_prefill(q, k_cache, v_cache, attn, scale, window)
    dtype = q.dtype
    q, k, v = (x.to(k_cache.dtype) for x in (q, k, v))
    return _torch_prefill(q, k, v, k_cache, v_cache, attn.prefill, scale, window).to(dtype)


def _kernel_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionMetadata,
                    scale: float, window: int | None) -> torch.Tensor:
    # q: [T, H, D] -> [T, H, D]. The kernel reads q's rows where they are (a strided slice of the
    # fused QKV output) and writes each chunk's rows into the step's output: no copy of either.
    q32 = q.float()
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for meta in attn.prefill:
        rows = slice(meta.query_start, meta.query_start + meta.query_len)
        attn.prefill_kernels.paged_prefill_attention(q32[rows], k_cache, v_cache, meta.block_table,
                                                     meta.num_cached_tokens, attn.block_size, scale, window or 0,
                                                     attn.kernel_isa, out[rows])
    return out.to(q.dtype)


def _torch_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, seqs: list[PrefillSeqMeta], scale: float,
                   window: int | None = None) -> torch.Tensor:
    # q: [T, H, D]; k, v: [T, KVH, D] -> out: [T, H, D]
    out = torch.empty_like(q)
    for meta in seqs:
        rows = slice(meta.query_start, meta.query_start + meta.query_len)
        # [1, heads, n, D] views of the packed rows: SDPA's flash kernel reads them strided (and
        # shares K/V heads itself, GQA), while 3-D [heads, n, D] input sends it to the math path,
        # about 4x slower for a 500-token chunk.
        q_i, k_i, v_i = (x[rows].unsqueeze(0).transpose(1, 2) for x in (q, k, v))
        if window is not None and meta.context_len > window:
            o_i = _masked_attention(q_i, k_i, v_i, k_cache, v_cache, meta, scale, window)
        elif meta.num_cached_tokens == 0:
            o_i = F.scaled_dot_product_attention(q_i, k_i, v_i, is_causal=True, scale=scale, enable_gqa=True)
        elif q.device.type == "cpu":
            o_i = _cached_then_causal(q_i, k_i, v_i, k_cache, v_cache, meta, scale)
        else:
            o_i = _masked_attention(q_i, k_i, v_i, k_cache, v_cache, meta, scale, window)
        out[rows] = o_i[0].transpose(0, 1)
    return out


def _cached_keys(cache: torch.Tensor, meta: PrefillSeqMeta) -> torch.Tensor:
    """The sequence's cached K or V rows, [1, KVH, num_cached, D]: a view of the pool when its
    blocks are consecutive (a fresh long prompt's usually are), else gathered."""
    n = meta.num_cached_tokens
    if meta.cached_slot_start is not None:
        rows = cache[meta.cached_slot_start : meta.cached_slot_start + n]
    else:
        rows = cache.index_select(0, meta.context_slots[:n])
    return rows.unsqueeze(0).transpose(1, 2)


def _cached_then_causal(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, meta: PrefillSeqMeta, scale: float) -> torch.Tensor:
    """A chunk after a cached context, with no mask: every cached token precedes every new one, so
    the chunk attends to the cache without one and to itself causally, each by the flash kernel,
    and the two softmaxes merge by their log-sum-exps (the weight of the cached part is
    sigmoid(lse_cached - lse_new)). q: [1, H, n, D] -> [1, H, n, D]."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    o_old, lse_old = flash(q, _cached_keys(k_cache, meta), _cached_keys(v_cache, meta), 0.0, False, scale=scale)
    o_new, lse_new = flash(q, k_new, v_new, 0.0, True, scale=scale)
    w_old = torch.sigmoid(lse_old - lse_new).unsqueeze(-1).to(o_new.dtype)  # [1, H, n, 1]; lse is float32
    return torch.lerp(o_new, o_old, w_old)


def _masked_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, meta: PrefillSeqMeta, scale: float, window: int | None) -> torch.Tensor:
    """The general path (sliding windows, non-CPU devices): one SDPA over the whole context with
    an explicit mask. q: [1, H, n, D] -> [1, H, n, D]."""
    if meta.num_cached_tokens:
        k_ctx = torch.cat((_cached_keys(k_cache, meta), k_new), dim=2)
        v_ctx = torch.cat((_cached_keys(v_cache, meta), v_new), dim=2)
    else:
        k_ctx, v_ctx = k_new, v_new
    rows = torch.arange(meta.query_len, device=q.device).unsqueeze(1) + meta.num_cached_tokens
    cols = torch.arange(meta.context_len, device=q.device).unsqueeze(0)
    mask = cols <= rows
    if window is not None:
        mask &= cols > rows - window
    return F.scaled_dot_product_attention(q, k_ctx, v_ctx, attn_mask=mask, scale=scale, enable_gqa=True)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionMetadata,
                     scale: float, window: int | None = None) -> torch.Tensor:
    # q: [B, H, D] -> out: [B, H, D] in q's dtype (the fused layers' q is float32 over any cache)
    if attn.decode_kernels is not None:
        return attn.decode_kernels.paged_decode_attention(q.to(k_cache.dtype), k_cache, v_cache, attn.block_tables,
                                                          attn.context_lens, attn.block_size, scale,
                                                          window or 0, attn.kernel_isa).to(q.dtype)
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
    # In q's dtype: a bfloat16 cache beside float32 weights is widened, its products exact.
    k = k_cache[slots].to(q.dtype).permute(0, 2, 3, 1)  # [B, KVH, D, L]
    v = v_cache[slots].to(q.dtype).transpose(1, 2)  # [B, KVH, L, D]
    q = q.view(batch, num_kv_heads, group, head_dim)
    scores = torch.matmul(q, k) * scale + mask  # [B, KVH, G, L]
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v).view(batch, num_heads, head_dim)
