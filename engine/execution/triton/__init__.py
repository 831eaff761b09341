"""Paged-attention kernels in Triton, for the CUDA backend: a split-K decode kernel and a
prefill / chunked-prefill kernel, both reading K/V through the block table in place; and the
decoder layer's elementwise parts, one kernel each (pointwise.py: RMS norm, RoPE, SiLU * up).

Cache layout per layer (as engine/execution/attention.py): k_cache, v_cache:
[num_slots, num_kv_heads, head_dim], float32 or bfloat16, slot = block_id * block_size + offset.
The step's new tokens' K/V are already written into the cache when these run. A layer with a
sliding window W > 0 lets the query at position p see keys j with p - W < j <= p (transformers'
definition); W = 0 means no window. The scores, softmax and output accumulate in float32; the
products take the cache's dtype (q is rounded to it, as the C++ decode path does).

Triton is imported only when a kernel is first called: this package imports on a machine
without it, and is_available() says whether the kernels can run. Off CUDA they run only under
Triton's interpreter, which TRITON_INTERPRET=1 selects at the time the kernel modules are
imported (the tests do this on the CPU)."""
from __future__ import annotations

import functools
import logging
import os

import torch

logger = logging.getLogger(__name__)

__all__ = ["decode_attention", "is_available", "prefill_attention"]


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401 - the import itself is the check
    except ImportError:
        return False
    except Exception as exc:  # noqa: BLE001 - a broken install means: not available
        logger.warning("triton is installed but does not import (%s)", exc)
        return False
    return True


def is_available() -> bool:
    """True when Triton imports and there is something to run the kernels on: a CUDA GPU, or
    Triton's interpreter (TRITON_INTERPRET=1)."""
    if not _triton_importable():
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, block_size: int, scale: float, window: int, out: torch.Tensor,
                     max_context_len: int | None = None, partition_size: int | None = None, block_n: int = 64,
                     num_warps: int = 4, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence over its paged context, into out; returns out.

    q: [B, H, D] float32 or bfloat16; k_cache, v_cache: [num_slots, KVH, D], one dtype (float32 or
    bfloat16), H a multiple of KVH; block_tables: [B, max_blocks] int32 (entries past a
    sequence's context are never read); context_lens: [B] int32, the cached tokens including the
    current one (0: a padding row, whose output is 0); out: [B, H, D] in q's dtype.
    max_context_len bounds every context_len (default: max_blocks * block_size) and sizes the
    split-K grid: cdiv(max_context_len, partition_size) partitions per (sequence, KV head), the
    partition doubled while there would be more than 128; a context beyond the bound is still
    attended in full, by its last partition. partition_size: keys per partition, a power of two
    >= block_n (default: decode.default_partition_size, from the grid and the GPU's SM count);
    block_n: keys per tile (a power of two >= 16). sinks: [H], each head's sink logit in its
    softmax's denominator (gpt-oss), or None."""
    from engine.execution.triton import decode

    return decode.decode_attention(q, k_cache, v_cache, block_tables, context_lens, block_size, scale, window, out,
                                   max_context_len, partition_size, block_n, num_warps, sinks)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_size: int, scale: float,
                      window: int, out: torch.Tensor, max_query_len: int, block_m: int | None = None,
                      block_n: int = 64, num_warps: int = 4, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of packed chunks over their paged contexts, into out; returns out.

    q: [T, H, D] float32 or bfloat16, the chunks packed: sequence i owns rows
    [query_start_loc[i], query_start_loc[i + 1]), its tokens at positions
    [seq_lens[i] - query_len_i, seq_lens[i]); query_start_loc: [B + 1] int32, ascending from 0;
    seq_lens: [B] int32, each sequence's tokens in the cache after this chunk (its K/V for
    positions [0, seq_lens[i]) are all in the cache); block_tables: [B, max_blocks] int32;
    out: [T, H, D] in q's dtype (rows outside every chunk are left as they are).
    max_query_len bounds every query_len and sizes the grid. block_m: rows (tokens x group) per
    program, a power of two >= 16 and >= the group (default from max_query_len); block_n: keys per
    tile. The defaults, 64-row tiles of 64 keys on 4 warps, beat 128-row tiles and 32-key tiles
    on a GPU, on long prompts and on short checks after a long cached context. sinks: as
    decode_attention's."""
    from engine.execution.triton import prefill

    return prefill.prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, block_size, scale,
                                     window, out, max_query_len, block_m, block_n, num_warps, sinks)
