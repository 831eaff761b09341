"""Paged prefill / chunked-prefill attention in Triton: packed variable-length chunks, causal,
over each sequence's whole paged context, flash-attention style.

Grid (B, cdiv(max_query_len, BLOCK_Q), KVH): a program takes BLOCK_Q consecutive query tokens of
one sequence and the GROUP query heads of one KV head, flattened into BLOCK_M = BLOCK_Q * GROUP
rows (padded to a power of two), so each K/V tile read through the block table serves the whole
group (GQA). It walks the key tiles from the window's start (or 0) to its last token's position,
with an online softmax in float32: the context is never gathered densely. Programs past their
sequence's query_len return at once, so one grid serves a batch of mixed chunk lengths: long
prompts, chunks after a cached prefix, and speculative-decoding checks (k + 1 queries after a
long cached context).

CUDA graphs: the grid comes from host ints only (B, max_query_len, KVH); nothing reads a tensor
on the host."""
import torch
import triton
import triton.language as tl

from engine.execution.triton._checks import check_attention_common, check_int, check_pow2, check_tensor, next_pow2
from engine.execution.triton._tiles import emulates_bf16, fold_sink, load_k_t, load_v, mma, softmax_step, tile_slots

LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    q_ptr: tl.tensor, k_cache_ptr: tl.tensor, v_cache_ptr: tl.tensor, block_tables_ptr: tl.tensor,
    query_start_loc_ptr: tl.tensor, seq_lens_ptr: tl.tensor, out_ptr: tl.tensor, sinks_ptr: tl.tensor,
    scale_log2: float, window: int,
    stride_qt: int, stride_qh: int, stride_ks: int, stride_kh: int, stride_vs: int, stride_vh: int,
    stride_tb: int, stride_ot: int, stride_oh: int,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    IS_FP32: tl.constexpr, EMULATE_BF16: tl.constexpr, HAS_SINKS: tl.constexpr,
) -> None:
    """One (sequence, tile of BLOCK_Q query tokens, KV head). q, out: [T, H, D]; caches:
    [num_slots, KVH, D]; block_tables: [B, max_blocks]; query_start_loc: [B + 1]; seq_lens: [B];
    sinks: [H] float32 (read only when HAS_SINKS)."""
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_row = q_tile * BLOCK_Q  # of this tile, within the sequence's chunk
    if first_row >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    num_cached = seq_len - query_len  # the chunk's tokens sit at positions [num_cached, seq_len)
    cache_ty = k_cache_ptr.dtype.element_ty

    rows = tl.arange(0, BLOCK_M)
    token = first_row + rows // GROUP  # [BLOCK_M] token within the chunk; GROUP heads per token
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (token < query_len)
    pos = num_cached + token  # [BLOCK_M] each row's position in the sequence
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q_rows = (q_start + token).to(tl.int64) * stride_qt + head * stride_qh  # [BLOCK_M]
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :],
                other=0.0).to(cache_ty)  # [BLOCK_M, BLOCK_D]

    # Keys [lo, hi): up to the tile's last position (causal), from the first one its window keeps
    hi = num_cached + tl.minimum(first_row + BLOCK_Q, query_len)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(num_cached + first_row - window + 1, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_tb
    for tile_start in range(lo, hi, BLOCK_N):
        keys = tile_start + tl.arange(0, BLOCK_N)
        key_ok = keys < hi
        slots = tile_slots(table_ptr, keys, key_ok, BLOCK_SIZE)
        k_t = load_k_t(k_cache_ptr, slots, key_ok, kv_head, stride_ks, stride_kh, dims, dim_ok)
        v = load_v(v_cache_ptr, slots, key_ok, kv_head, stride_vs, stride_vh, dims, dim_ok)
        scores = mma(q, k_t, IS_FP32, EMULATE_BF16) * scale_log2  # [BLOCK_M, BLOCK_N]
        visible = key_ok[None, :] & (keys[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible &= keys[None, :] > pos[:, None] - window
        scores = tl.where(visible, scores, float("-inf"))
        m_i, l_i, acc = softmax_step(scores, m_i, l_i, acc, v, IS_FP32, EMULATE_BF16)

    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i, acc = fold_sink(m_i, l_i, acc, sink)
    # every real row sees at least its own key (l > 0); padded rows are not stored
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_rows = (q_start + token).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_ptr + o_rows[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


def default_block_m(group: int, max_query_len: int) -> int:
    """Rows per program: at least 16 (the smallest tl.dot tile) and one token's whole group; up to
    64 for long chunks, where a taller tile reads each K/V tile for more queries."""
    smallest = max(16, next_pow2(group))
    return max(smallest, min(max(64, smallest), next_pow2(max(1, max_query_len) * group)))


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_size: int, scale: float,
                      window: int, out: torch.Tensor, max_query_len: int, block_m: int | None = None,
                      block_n: int = 64, num_warps: int = 4, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """See engine.execution.triton.prefill_attention."""
    num_seqs = seq_lens.shape[0] if isinstance(seq_lens, torch.Tensor) and seq_lens.dim() == 1 else -1
    check_tensor("seq_lens", seq_lens, 1, (torch.int32,))
    num_heads, num_kv_heads, head_dim, group = check_attention_common(q, k_cache, v_cache, out, block_tables,
                                                                      num_seqs, block_size, scale, window)
    check_tensor("query_start_loc", query_start_loc, 1, (torch.int32,))
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(f"query_start_loc: expected {num_seqs + 1} entries (one per sequence, plus the end), "
                         f"got {query_start_loc.shape[0]}")
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device}, but q is on {q.device}")
    check_int("max_query_len", max_query_len, 0)
    check_pow2("block_n", block_n, 16)
    if block_m is None:
        block_m = default_block_m(group, max_query_len)
    check_pow2("block_m", block_m, 16)
    if block_m < group:
        raise ValueError(f"block_m: {block_m} rows cannot hold one token's {group} query heads")
    if num_seqs == 0 or max_query_len == 0 or q.shape[0] == 0:
        return out
    sinks = _checked_sinks(sinks, num_heads, q.device)
    block_q = block_m // group
    grid = (num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, out if sinks is None else sinks,
        float(scale) * LOG2E, window,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_D=max(16, next_pow2(head_dim)),
        BLOCK_N=block_n, BLOCK_SIZE=block_size, HAS_WINDOW=window > 0, IS_FP32=k_cache.dtype == torch.float32,
        EMULATE_BF16=emulates_bf16(_prefill_kernel), HAS_SINKS=sinks is not None, num_warps=num_warps)
    return out


def _checked_sinks(sinks: torch.Tensor | None, num_heads: int, device: torch.device) -> torch.Tensor | None:
    """sinks as the kernels read them: [H] float32, contiguous, on q's device (None: none)."""
    if sinks is None:
        return None
    if sinks.shape != (num_heads,) or sinks.device != device:
        raise ValueError(f"sinks: expected shape ({num_heads},) on {device}, got {tuple(sinks.shape)} on {sinks.device}")
    return sinks.float().contiguous()
