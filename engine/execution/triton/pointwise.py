"""A decoder layer's elementwise parts in Triton, one kernel each where torch runs several: the RMS
norm (8 kernels in torch's ops: float, square, mean, add, rsqrt, two products, the cast), the
rotary embedding of q and k with their K/V cache writes (12: two products, a negation, a
concatenation and a sum for each, and the two copies), and SiLU(gate) * up (2). A batch-1
decode step of a small model on a GPU is some 40 kernels a layer of a few microseconds each, so
their count, not their work, sets the step; these take a layer to about 11 (the residual add
before the MLP's norm rides in that norm's kernel).

Each rounds where torch's ops round, so a bfloat16 model's values are those of the modules they
stand in for and a float32 model's are float32 throughout; the exceptions are the norm's sum of
squares, in the kernel's own order (a float32 result moves by a few ulps), and exp (SiLU's).
"""
import torch
import triton
import triton.language as tl

from engine.execution.triton._checks import next_pow2
from engine.execution.triton._tiles import emulates_bf16


@triton.jit
def _rounded(x: tl.tensor, ty: tl.constexpr, EMULATE_BF16: tl.constexpr) -> tl.tensor:
    """float32 x in dtype ty, rounded to nearest even as torch rounds. The interpreter truncates
    its bfloat16 cast, so there (EMULATE_BF16) the rounding is written out (finite values: the
    tests'); a GPU's cast rounds to nearest even itself, NaN kept."""
    if EMULATE_BF16 and ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    return x.to(ty)


@triton.jit
def _normed(x: tl.tensor, w_ptr: tl.tensor, cols: tl.tensor, ok: tl.tensor, num_cols: int, eps: float,
            out_ty: tl.constexpr, EMULATE_BF16: tl.constexpr) -> tl.tensor:
    """A row x in its dtype -> w * (x * rsqrt(mean(x^2) + eps)) in out_ty, the normalised row
    rounded to x's dtype before the weight's product (RMSNorm.forward's order)."""
    xf = x.to(tl.float32)
    mean = tl.sum(xf * xf, 0) / num_cols
    y = _rounded(xf * tl.math.rsqrt(mean + eps), x.dtype, EMULATE_BF16)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    return _rounded(w.to(tl.float32) * y.to(tl.float32), out_ty, EMULATE_BF16)


@triton.jit
def _rms_norm_kernel(x_ptr: tl.tensor, w_ptr: tl.tensor, out_ptr: tl.tensor, num_inner: int, stride_xo: int,
                     stride_xi: int, stride_oo: int, stride_oi: int, num_cols: int, eps: float,
                     BLOCK: tl.constexpr, EMULATE_BF16: tl.constexpr) -> None:
    """One row of x [outer, inner, cols], normed."""
    row = tl.program_id(0)
    outer, inner = row // num_inner, row % num_inner
    cols = tl.arange(0, BLOCK)
    ok = cols < num_cols
    x = tl.load(x_ptr + outer.to(tl.int64) * stride_xo + inner * stride_xi + cols, mask=ok, other=0.0)
    out = _normed(x, w_ptr, cols, ok, num_cols, eps, out_ptr.dtype.element_ty, EMULATE_BF16)
    tl.store(out_ptr + outer.to(tl.int64) * stride_oo + inner * stride_oi + cols, out, mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., N] (2 or 3 dims, the last contiguous), weight: [N] -> a new [..., N] tensor in
    the dtype torch's `weight * x_normed.to(x.dtype)` gives."""
    if x.dim() not in (2, 3) or x.stride(-1) != 1 or weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm: x {tuple(x.shape)} (strides {x.stride()}) and weight {tuple(weight.shape)}: "
                         "x must be [rows, N] or [rows, heads, N] with its last dimension contiguous, weight [N]")
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    out3 = out if out.dim() == 3 else out.unsqueeze(1)
    outer, inner, num_cols = x3.shape
    if outer * inner == 0:
        return out
    block = next_pow2(num_cols)
    # a row a program: its warps sized to the row (a wide hidden size in a few registers a thread)
    _rms_norm_kernel[(outer * inner,)](x3, weight, out3, inner, x3.stride(0), x3.stride(1), out3.stride(0),
                                       out3.stride(1), num_cols, float(eps), BLOCK=block,
                                       EMULATE_BF16=emulates_bf16(_rms_norm_kernel),
                                       num_warps=max(1, min(16, block // 256)))
    return out


@triton.jit
def _add_rms_norm_kernel(x_ptr: tl.tensor, r_ptr: tl.tensor, w_ptr: tl.tensor, out_ptr: tl.tensor, sum_ptr: tl.tensor,
                         stride_x: int, stride_r: int, stride_o: int, stride_s: int, num_cols: int, eps: float,
                         BLOCK: tl.constexpr, EMULATE_BF16: tl.constexpr) -> None:
    """One row: s = residual + x (rounded to their dtype), written out, and out = the norm of s."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < num_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    r = tl.load(r_ptr + row * stride_r + cols, mask=ok, other=0.0)
    s = _rounded(r.to(tl.float32) + x.to(tl.float32), x.dtype, EMULATE_BF16)
    tl.store(sum_ptr + row * stride_s + cols, s, mask=ok)
    tl.store(out_ptr + row * stride_o + cols,
             _normed(s, w_ptr, cols, ok, num_cols, eps, out_ptr.dtype.element_ty, EMULATE_BF16), mask=ok)


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """residual, x: [T, N] of one dtype (rows contiguous), weight: [N] -> (residual + x, its
    rms_norm), new tensors, in one launch."""
    if x.dim() != 2 or residual.shape != x.shape or residual.dtype != x.dtype or x.stride(-1) != 1 or \
            residual.stride(-1) != 1 or weight.shape != (x.shape[-1],):
        raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} and x {tuple(x.shape)} must be [T, N] of one "
                         f"dtype, rows contiguous, weight {tuple(weight.shape)} [N]")
    total = torch.empty_like(x)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if x.shape[0]:
        block = next_pow2(x.shape[1])
        _add_rms_norm_kernel[(x.shape[0],)](x, residual, weight, out, total, x.stride(0), residual.stride(0),
                                            out.stride(0), total.stride(0), x.shape[1], float(eps), BLOCK=block,
                                            EMULATE_BF16=emulates_bf16(_add_rms_norm_kernel),
                                            num_warps=max(1, min(16, block // 256)))
    return total, out


@triton.jit
def _rotary_kernel(q_ptr: tl.tensor, k_ptr: tl.tensor, v_ptr: tl.tensor, cos_ptr: tl.tensor, sin_ptr: tl.tensor,
                   k_cache_ptr: tl.tensor, v_cache_ptr: tl.tensor, slot_ptr: tl.tensor, num_q_heads: int,
                   num_kv_heads: int, stride_qt: int, stride_qh: int, stride_kt: int, stride_kh: int, stride_vt: int,
                   stride_vh: int, stride_ct: int, stride_cs: int, stride_ch: int, half: int, BLOCK: tl.constexpr,
                   WRITE_CACHE: tl.constexpr, EMULATE_BF16: tl.constexpr) -> None:
    """One (token, head) row: heads [0, Hq) are q's, [Hq, Hq + Hk) k's, rotated in place: x * cos +
    rotate_half(x) * sin, each product and the sum rounded to x's dtype as torch's ops round them.
    WRITE_CACHE: a k row goes into k_cache at the token's slot too, and heads [Hq + Hk, Hq + 2 Hk)
    copy v's rows into v_cache (write_kv's job), in the caches' dtype."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    ok = cols < half
    if WRITE_CACHE:
        slot = tl.load(slot_ptr + token).to(tl.int64)
    if head < num_q_heads + num_kv_heads:
        if head < num_q_heads:
            base = q_ptr + token.to(tl.int64) * stride_qt + head * stride_qh
        else:
            base = k_ptr + token.to(tl.int64) * stride_kt + (head - num_q_heads) * stride_kh
        x1 = tl.load(base + cols, mask=ok, other=0.0)
        x2 = tl.load(base + half + cols, mask=ok, other=0.0)
        ty = x1.dtype
        c1 = tl.load(cos_ptr + token.to(tl.int64) * stride_ct + cols, mask=ok, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + token.to(tl.int64) * stride_ct + half + cols, mask=ok, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + token.to(tl.int64) * stride_ct + cols, mask=ok, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + token.to(tl.int64) * stride_ct + half + cols, mask=ok, other=0.0).to(tl.float32)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        # rotate_half(x) = [-x2, x1]
        y1 = _rounded(f1 * c1, ty, EMULATE_BF16).to(tl.float32) + _rounded(-f2 * s1, ty, EMULATE_BF16).to(tl.float32)
        y2 = _rounded(f2 * c2, ty, EMULATE_BF16).to(tl.float32) + _rounded(f1 * s2, ty, EMULATE_BF16).to(tl.float32)
        r1, r2 = _rounded(y1, ty, EMULATE_BF16), _rounded(y2, ty, EMULATE_BF16)
        tl.store(base + cols, r1, mask=ok)
        tl.store(base + half + cols, r2, mask=ok)
        if WRITE_CACHE:
            if head >= num_q_heads:
                dst = k_cache_ptr + slot * stride_cs + (head - num_q_heads) * stride_ch
                cache_ty = k_cache_ptr.dtype.element_ty
                tl.store(dst + cols, _rounded(r1.to(tl.float32), cache_ty, EMULATE_BF16), mask=ok)
                tl.store(dst + half + cols, _rounded(r2.to(tl.float32), cache_ty, EMULATE_BF16), mask=ok)
    elif WRITE_CACHE:
        kv_head = head - num_q_heads - num_kv_heads
        src = v_ptr + token.to(tl.int64) * stride_vt + kv_head * stride_vh
        dst = v_cache_ptr + slot * stride_cs + kv_head * stride_ch
        cache_ty = v_cache_ptr.dtype.element_ty
        v1 = tl.load(src + cols, mask=ok, other=0.0).to(tl.float32)
        v2 = tl.load(src + half + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(dst + cols, _rounded(v1, cache_ty, EMULATE_BF16), mask=ok)
        tl.store(dst + half + cols, _rounded(v2, cache_ty, EMULATE_BF16), mask=ok)


def cache_write_problem(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> str | None:
    """Why rotary cannot write these into the caches itself (None: it can)."""
    if v.shape != k.shape or v.stride(-1) != 1:
        return f"v {tuple(v.shape)} must be shaped as k {tuple(k.shape)}, its last dimension contiguous"
    if k_cache.dim() != 3 or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() or \
            k_cache.dtype != v_cache.dtype or k_cache.shape[1:] != k.shape[1:] or k_cache.stride(-1) != 1:
        return (f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must be [num_slots, Hk, D] alike "
                "(strides and dtype too), rows contiguous")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.stride(0) != 1 or slot_mapping.is_floating_point():
        return f"slot_mapping {tuple(slot_mapping.shape)} must be [T] integers, contiguous"
    return None


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, v: torch.Tensor | None = None,
           k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
           slot_mapping: torch.Tensor | None = None) -> None:
    """q: [T, Hq, D], k: [T, Hk, D] (their last dimension contiguous; views of one QKV row are
    fine), cos, sin: [T, 1, D] (or [T, D]) in their dtype: rotated in place. With v ([T, Hk, D]),
    the caches ([num_slots, Hk, D], one dtype, rows contiguous) and slot_mapping ([T] int64): the
    rotated k and v written at each token's slot as well, in one launch (write_kv's copies)."""
    num_tokens, num_q_heads, head_dim = q.shape
    if k.dim() != 3 or k.shape[0] != num_tokens or k.shape[2] != head_dim or q.stride(-1) != 1 or \
            k.stride(-1) != 1 or head_dim % 2 or k.dtype != q.dtype:
        raise ValueError(f"rotary: q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, heads, D] of one dtype, D even, "
                         "their last dimension contiguous")
    num_kv_heads = k.shape[1]
    cos2, sin2 = cos.reshape(num_tokens, head_dim), sin.reshape(num_tokens, head_dim)
    if cos2.stride(-1) != 1 or cos2.stride() != sin2.stride():
        raise ValueError("rotary: cos and sin must be [T, D] alike, their last dimension contiguous")
    write_cache = k_cache is not None
    if write_cache:
        if v is None or v_cache is None or slot_mapping is None:
            raise ValueError("rotary: writing the cache takes v, k_cache, v_cache and slot_mapping together")
        if (problem := cache_write_problem(k, v, k_cache, v_cache, slot_mapping)) is not None:
            raise ValueError(f"rotary: {problem}")
    else:
        v, k_cache, v_cache, slot_mapping = k, k, k, k  # unread
    if num_tokens == 0:
        return
    half = head_dim // 2
    # No fused multiply-adds: torch rounds each product, then the sum (float32 too, bit for bit).
    _rotary_kernel[(num_tokens, num_q_heads + (2 if write_cache else 1) * num_kv_heads)](
        q, k, v, cos2, sin2, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos2.stride(0), k_cache.stride(0), k_cache.stride(1), half,
        BLOCK=next_pow2(half), WRITE_CACHE=write_cache, EMULATE_BF16=emulates_bf16(_rotary_kernel), num_warps=1,
        enable_fp_fusion=False)


@triton.jit
def _silu_and_mul_kernel(x_ptr: tl.tensor, out_ptr: tl.tensor, num_cols: int, stride_x: int, stride_o: int,
                         BLOCK: tl.constexpr, EMULATE_BF16: tl.constexpr) -> None:
    """One block of one row of x = [gate | up]: silu(gate) rounded to x's dtype, times up."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < num_cols
    base = x_ptr + row.to(tl.int64) * stride_x
    gate = tl.load(base + cols, mask=ok, other=0.0)
    up = tl.load(base + num_cols + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    act = _rounded(g / (1.0 + tl.exp(-g)), gate.dtype, EMULATE_BF16)
    out = _rounded(act.to(tl.float32) * up.to(tl.float32), out_ptr.dtype.element_ty, EMULATE_BF16)
    tl.store(out_ptr + row.to(tl.int64) * stride_o + cols, out, mask=ok)


def silu_and_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """gate_up: [T, 2 I] (gate then up, the last dimension contiguous) -> silu(gate) * up, [T, I]."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"silu_and_mul: gate_up {tuple(gate_up.shape)} must be [T, 2 I], its last dimension contiguous")
    num_tokens, width = gate_up.shape
    out = torch.empty((num_tokens, width // 2), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens:
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(width // 2, block))](
            gate_up, out, width // 2, gate_up.stride(0), out.stride(0), BLOCK=block,
            EMULATE_BF16=emulates_bf16(_silu_and_mul_kernel))
    return out
