"""Attention by torch's own ops: the reference backend's, and the CPU backend's where its C++
kernels do not run (an AVX2 CPU's prefill). Every other backend is tested against these.

- prefill: per sequence, causal attention of its chunk over its whole context. A sequence with
  nothing cached attends over the fresh K/V directly (SDPA's flash kernel); one with a cached
  prefix (prefix hit, later chunk, recompute) attends to the cache and to itself separately,
  merged by log-sum-exp (no mask); the cache is read in place when its slots are consecutive.
  Sliding windows and non-CPU devices take one SDPA over the context with an explicit mask.
- decode: all contexts gathered at once through a [B, L] slot index shared by every layer,
  padded positions masked out.
- sinks (gpt-oss): prefill by the eager form transformers' gpt-oss uses (scores, the sink logit
  appended to each row, softmax, the sink's column dropped), decode by the same append in the
  gathered scores.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.execution.attention import AttentionBackend, AttentionMetadata, PrefillSeqMeta


class TorchAttention(AttentionBackend):
    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, attn: AttentionMetadata, scale: float, window: int | None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] -> [T, H, D] in q's dtype (the math in the cache's dtype)."""
        dtype = q.dtype
        q, k, v = (x.to(k_cache.dtype) for x in (q, k, v))
        return _torch_prefill(q, k, v, k_cache, v_cache, attn.prefill, scale, window, sinks).to(dtype)

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionMetadata,
               scale: float, window: int | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        # q: [B, H, D] -> out: [B, H, D]
        mask = attn.decode_mask.to(q.dtype)  # [B, 1, 1, L]; the scores' dtype, so softmax and P.V stay in it
        if window is not None:
            # Keys before context_len - window fall out of the window: [B, 1, 1, L]
            cols = torch.arange(mask.shape[-1], device=mask.device)
            outside = cols.unsqueeze(0) < (attn.context_lens - window).unsqueeze(1)
            mask = mask.masked_fill(outside.view(mask.shape), float("-inf"))
        return gathered_decode_attention(q, k_cache, v_cache, attn.decode_slots, mask, scale, sinks)

    def prepare_decode(self, attn: AttentionMetadata, block_tables: torch.Tensor, context_lens: torch.Tensor) -> None:
        """One [B, L] slot index and additive mask for the whole step, shared by every layer."""
        super().prepare_decode(attn, block_tables, context_lens)
        batch, max_blocks = block_tables.shape
        bs = attn.block_size
        offsets = torch.arange(bs, dtype=block_tables.dtype, device=block_tables.device)
        attn.decode_slots = (block_tables[:, :, None] * bs + offsets).reshape(batch, -1)
        cols = torch.arange(max_blocks * bs, device=context_lens.device)
        mask = torch.zeros(batch, max_blocks * bs, device=context_lens.device)
        attn.decode_mask = mask.masked_fill(cols >= context_lens[:, None], float("-inf")).view(batch, 1, 1, -1)


def _torch_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, seqs: list[PrefillSeqMeta], scale: float,
                   window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    # q: [T, H, D]; k, v: [T, KVH, D]; sinks: [H] or None -> out: [T, H, D]
    out = torch.empty_like(q)
    for meta in seqs:
        rows = slice(meta.query_start, meta.query_start + meta.query_len)
        # [1, heads, n, D] views of the packed rows: SDPA's flash kernel reads them strided (and
        # shares K/V heads itself, GQA), while 3-D [heads, n, D] input sends it to the slower
        # math path.
        q_i, k_i, v_i = (x[rows].unsqueeze(0).transpose(1, 2) for x in (q, k, v))
        if sinks is not None:
            o_i = _masked_attention(q_i, k_i, v_i, k_cache, v_cache, meta, scale, window, sinks)
        elif window is not None and meta.context_len > window:
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
                      v_cache: torch.Tensor, meta: PrefillSeqMeta, scale: float, window: int | None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The general path (sliding windows, non-CPU devices, sinks): one SDPA over the whole context
    with an explicit mask (with sinks, the eager form). q: [1, H, n, D] -> [1, H, n, D]."""
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
    if sinks is not None:
        return _sink_attention(q, k_ctx, v_ctx, mask, scale, sinks)
    return F.scaled_dot_product_attention(q, k_ctx, v_ctx, attn_mask=mask, scale=scale, enable_gqa=True)


def _sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                    sinks: torch.Tensor) -> torch.Tensor:
    """Attention with a sink logit per head, as transformers' gpt-oss computes it (no SDPA takes
    sinks). q: [1, H, n, D]; k, v: [1, KVH, L, D]; mask: [n, L] bool (True: visible); sinks: [H]
    -> [1, H, n, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [1, H, L, D]
    scores = torch.matmul(q, k.transpose(2, 3)) * scale  # [1, H, n, L]
    scores = scores.masked_fill(~mask, float("-inf"))
    return _softmax_with_sinks(scores, sinks.to(scores.dtype).view(1, -1, 1, 1)) @ v


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """scores: [..., L]; sinks broadcastable to [..., 1] -> the keys' probabilities [..., L],
    the sink's share of each row left out."""
    combined = torch.cat((scores, sinks.expand(*scores.shape[:-1], 1)), dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    return torch.softmax(combined, dim=-1)[..., :-1]


def gathered_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                              mask: torch.Tensor, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    # q: [B, H, D]; slots: [B, L]; mask: [B, 1, 1, L]; sinks: [H] or None -> out: [B, H, D]
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    # GQA without repeating K/V: the `group` query heads of one KV head share a matmul.
    # In q's dtype: a bfloat16 cache beside float32 weights is widened, its products exact.
    k = k_cache[slots].to(q.dtype).permute(0, 2, 3, 1)  # [B, KVH, D, L]
    v = v_cache[slots].to(q.dtype).transpose(1, 2)  # [B, KVH, L, D]
    q = q.view(batch, num_kv_heads, group, head_dim)
    scores = torch.matmul(q, k) * scale + mask  # [B, KVH, G, L]
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        probs = _softmax_with_sinks(scores, sinks.to(scores.dtype).view(1, num_kv_heads, group, 1))
    return torch.matmul(probs, v).view(batch, num_heads, head_dim)
