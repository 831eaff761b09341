"""Split-K paged decode attention in Triton: one query token per sequence over its paged cache.

Grid (B, KVH, S): each program takes one sequence, one KV head with its GROUP query heads (the
rows of a tile, so K/V are read once per group: GQA), and one partition of partition_size keys. A
single long sequence thus still spreads over S * KVH programs. With S > 1 each program writes
its normalised partial output and log-sum-exp, and a second kernel (grid (B, H)) merges the S
partials of each head; with S == 1 the first kernel writes the output directly.

CUDA graphs: the grid comes from host ints only (B, KVH, and S from max_context_len, a bound
the caller knows: by default the block table's width times block_size); nothing reads a tensor
on the host. A sequence with context_len 0 (a padded batch row) gets zeros."""
import functools

import torch
import triton
import triton.language as tl

from engine.execution.triton._checks import check_attention_common, check_int, check_pow2, check_tensor, next_pow2
from engine.execution.triton._tiles import emulates_bf16, fold_sink, load_k_t, load_v, mma, softmax_step, tile_slots
from engine.execution.triton.prefill import _checked_sinks

LOG2E = 1.4426950408889634
MAX_SPLITS = 128  # bounds the merge kernel's [S, D] tile: a longer context gets longer partitions


@triton.jit
def _decode_partition_kernel(
    q_ptr: tl.tensor, k_cache_ptr: tl.tensor, v_cache_ptr: tl.tensor, block_tables_ptr: tl.tensor,
    context_lens_ptr: tl.tensor, out_ptr: tl.tensor, part_out_ptr: tl.tensor, part_lse_ptr: tl.tensor,
    sinks_ptr: tl.tensor, scale_log2: float, window: int, partition_size: int, num_splits: int,
    stride_qb: int, stride_qh: int, stride_ks: int, stride_kh: int, stride_vs: int, stride_vh: int,
    stride_tb: int, stride_ob: int, stride_oh: int,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr, DIRECT_OUT: tl.constexpr,
    IS_FP32: tl.constexpr, EMULATE_BF16: tl.constexpr, HAS_SINKS: tl.constexpr,
) -> None:
    """One (sequence, KV head, partition). q: [B, H, D]; caches: [num_slots, KVH, D];
    block_tables: [B, max_blocks]; context_lens: [B]; out: [B, H, D] (DIRECT_OUT) or
    part_out: [B, H, S, D] float32 and part_lse: [B, H, S] float32, in log2 units; sinks: [H]
    float32 (HAS_SINKS; folded in here when DIRECT_OUT, else by the merge)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    context_len = tl.load(context_lens_ptr + seq)
    start = split * partition_size
    # The last partition runs to the context's end: a context past the caller's bound is still
    # attended in full, only by fewer programs.
    end = tl.where(split == num_splits - 1, context_len, tl.minimum(start + partition_size, context_len))
    if HAS_WINDOW:
        # the query at p = context_len - 1 sees keys j with p - window < j <= p
        start = tl.maximum(start, context_len - window)
    cache_ty = k_cache_ptr.dtype.element_ty

    rows = tl.arange(0, BLOCK_G)  # query heads of this KV head; rows >= GROUP pad the tile to 16
    row_ok = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(cache_ty)  # [BLOCK_G, BLOCK_D]

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_tb
    for tile_start in range(start, end, BLOCK_N):
        keys = tile_start + tl.arange(0, BLOCK_N)
        key_ok = keys < end
        slots = tile_slots(table_ptr, keys, key_ok, BLOCK_SIZE)
        k_t = load_k_t(k_cache_ptr, slots, key_ok, kv_head, stride_ks, stride_kh, dims, dim_ok)
        v = load_v(v_cache_ptr, slots, key_ok, kv_head, stride_vs, stride_vh, dims, dim_ok)
        scores = mma(q, k_t, IS_FP32, EMULATE_BF16) * scale_log2  # [BLOCK_G, BLOCK_N]
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        m_i, l_i, acc = softmax_step(scores, m_i, l_i, acc, v, IS_FP32, EMULATE_BF16)

    if HAS_SINKS and DIRECT_OUT:
        sink = tl.load(sinks_ptr + heads, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i, acc = fold_sink(m_i, l_i, acc, sink)
    # An empty partition (past the context, or before the window) has l = 0: output 0, lse -inf.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if DIRECT_OUT:
        tl.store(out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    else:
        part = (seq.to(tl.int64) * num_heads + heads) * num_splits + split  # [BLOCK_G] rows of [B, H, S]
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], out, mask=row_ok[:, None] & dim_ok[None, :])
        # log2 of the guarded sum: log2(0) would be -inf already, but as a numerical warning
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)


@triton.jit
def _merge_partitions_kernel(
    part_out_ptr: tl.tensor, part_lse_ptr: tl.tensor, out_ptr: tl.tensor, sinks_ptr: tl.tensor, num_splits: int,
    stride_ob: int, stride_oh: int,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr,
) -> None:
    """One (sequence, head): out = sum_s o_s * 2^(lse_s - lse), lse = log2(sum_s 2^lse_s), the
    head's sink logit (HAS_SINKS) adding 2^sink to that sum."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    base = (seq.to(tl.int64) * tl.num_programs(1) + head) * num_splits
    splits = tl.arange(0, BLOCK_S)
    split_ok = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    lse = tl.load(part_lse_ptr + base + splits, mask=split_ok, other=float("-inf"))  # [BLOCK_S]
    lse_max = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        lse_max = tl.maximum(lse_max, sink)
    # every partition empty (context_len 0): weights 0, output 0, not NaN
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max)
    parts = tl.load(part_out_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :],
                    mask=split_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    total = tl.sum(weights, 0)
    if HAS_SINKS:
        total += tl.exp2(sink - lse_max)
    out = tl.sum(weights[:, None] * parts, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dim_ok)


@functools.cache
def _num_sms(device: torch.device) -> int:
    # one property read, cached: no sync, so it may run inside a CUDA graph capture
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def default_partition_size(batch: int, num_kv_heads: int, max_context_len: int, block_n: int,
                           device: torch.device) -> int:
    """Keys per partition: 1024, halved while the grid would give the GPU fewer programs than it
    has SMs, down to two tiles: on a GPU this came close to the best of 128..2048 at every shape
    tried, where a fixed 1024 starved a single short context of programs."""
    target = _num_sms(device)
    partition = 1024
    while partition > 2 * block_n and batch * num_kv_heads * triton.cdiv(max_context_len, partition) < target:
        partition //= 2
    return partition


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, block_size: int, scale: float, window: int, out: torch.Tensor,
                     max_context_len: int | None = None, partition_size: int | None = None, block_n: int = 64,
                     num_warps: int = 4, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """See engine.execution.triton.decode_attention."""
    batch = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() == 3 else -1  # a bad q is named below
    num_heads, num_kv_heads, head_dim, group = check_attention_common(q, k_cache, v_cache, out, block_tables, batch,
                                                                      block_size, scale, window)
    check_tensor("context_lens", context_lens, 1, (torch.int32,))
    if context_lens.shape[0] != batch or context_lens.device != q.device:
        raise ValueError(f"context_lens: expected shape ({batch},) on {q.device}, "
                         f"got {tuple(context_lens.shape)} on {context_lens.device}")
    check_pow2("block_n", block_n, 16)
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * block_size
    check_int("max_context_len", max_context_len, 0)
    if partition_size is None:
        partition_size = default_partition_size(batch, num_kv_heads, max_context_len, block_n, q.device)
    check_pow2("partition_size", partition_size, block_n)
    sinks = _checked_sinks(sinks, num_heads, q.device)
    if batch == 0:
        return out
    # Longer partitions once a context would need more than MAX_SPLITS of them
    while partition_size * MAX_SPLITS < max_context_len:
        partition_size *= 2
    num_splits = max(1, triton.cdiv(max_context_len, partition_size))
    direct = num_splits == 1
    if direct:
        part_out = part_lse = out  # unused: the kernel writes out itself
    else:
        # Allocated per call: inside a CUDA graph capture these come from the graph's private pool
        part_out = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    _decode_partition_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse, out if sinks is None else sinks,
        float(scale) * LOG2E, window, partition_size, num_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_G=max(16, next_pow2(group)), BLOCK_D=max(16, next_pow2(head_dim)),
        BLOCK_N=block_n, BLOCK_SIZE=block_size, HAS_WINDOW=window > 0, DIRECT_OUT=direct,
        IS_FP32=k_cache.dtype == torch.float32, EMULATE_BF16=emulates_bf16(_decode_partition_kernel),
        HAS_SINKS=sinks is not None, num_warps=num_warps)
    if not direct:
        _merge_partitions_kernel[(batch, num_heads)](
            part_out, part_lse, out, out if sinks is None else sinks, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_S=next_pow2(num_splits), BLOCK_D=next_pow2(head_dim),
            HAS_SINKS=sinks is not None, num_warps=1)
    return out
