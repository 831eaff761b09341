"""Argument checks shared by the Triton attention launchers (pure torch: no triton import).

Every check reads only shapes, dtypes and devices, never tensor contents: reading a value would
be a host sync, which a CUDA graph capture cannot hold."""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16)


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def check_tensor(name: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name}: dtype must be {allowed}, got {str(t.dtype).removeprefix('torch.')}")
    return t


def check_int(name: str, value: object, minimum: int) -> int:
    # bool is an int subclass, but True as a block size is a bug, not a 1
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
    return value


def check_pow2(name: str, value: object, minimum: int) -> int:
    check_int(name, value, minimum)
    if value & (value - 1):
        raise ValueError(f"{name}: must be a power of two, got {value}")
    return value


def check_attention_common(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                           block_tables: torch.Tensor, num_seqs: int, block_size: object, scale: object,
                           window: object) -> tuple[int, int, int, int]:
    """The checks both kernels share. q: [N, H, D]; caches: [num_slots, KVH, D]; out like q;
    block_tables: [num_seqs, max_blocks] int32. Returns (num_heads, num_kv_heads, head_dim, group)."""
    check_tensor("q", q, 3, FLOAT_DTYPES)
    check_tensor("k_cache", k_cache, 3, FLOAT_DTYPES)
    check_tensor("v_cache", v_cache, 3, FLOAT_DTYPES)
    check_tensor("out", out, 3, FLOAT_DTYPES)
    check_tensor("block_tables", block_tables, 2, (torch.int32,))
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    if k_cache.shape[2] != head_dim:
        raise ValueError(f"k_cache: head_dim {k_cache.shape[2]} differs from q's {head_dim}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: shape {tuple(v_cache.shape)} differs from k_cache's {tuple(k_cache.shape)}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache: dtype {v_cache.dtype} differs from k_cache's {k_cache.dtype}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"q: {num_heads} heads is not a multiple of the cache's {num_kv_heads} KV heads")
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out: expected shape {tuple(q.shape)} and dtype {q.dtype}, "
                         f"got {tuple(out.shape)} {out.dtype}")
    # The kernels read and write a head's row as one contiguous vector.
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t.stride(2) != 1:
            raise ValueError(f"{name}: the head_dim axis must be contiguous (stride 1), got {t.stride(2)}")
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables: expected {num_seqs} rows, got {block_tables.shape[0]}")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables: rows must be contiguous")
    check_int("block_size", block_size, 1)
    check_int("window", window, 0)
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not scale > 0:
        raise ValueError(f"scale: expected a positive float, got {scale!r}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("out", out), ("block_tables", block_tables)):
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device}, but q is on {q.device}")
    return num_heads, num_kv_heads, head_dim, num_heads // num_kv_heads
