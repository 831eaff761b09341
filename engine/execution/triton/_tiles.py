"""Triton device functions both attention kernels share: the paged key walk, the matmul policy
and one step of the online softmax; and whether a kernel runs in the interpreter (the pointwise
kernels ask too).

Scores are kept in log2 units (q.k * scale * log2(e)) so each exponential is one exp2."""
import triton
import triton.language as tl


def emulates_bf16(kernel: object) -> bool:
    """True under Triton's interpreter (TRITON_INTERPRET=1 when the kernel's module was imported),
    whose bfloat16 dot multiplies raw bits (see mma) and whose bfloat16 cast truncates."""
    return not isinstance(kernel, triton.runtime.JITFunction)


@triton.jit
def tile_slots(table_ptr: tl.tensor, keys: tl.tensor, key_ok: tl.tensor, BLOCK_SIZE: tl.constexpr) -> tl.tensor:
    """Cache slots of the logical key positions `keys` ([BLOCK_N] int32) through one sequence's
    block table row. Masked keys read no table entry, so padding entries are never touched."""
    block = tl.load(table_ptr + keys // BLOCK_SIZE, mask=key_ok, other=0)
    # int64: block_id * block_size * row stride overflows int32 on a large cache
    return block.to(tl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE  # [BLOCK_N]


@triton.jit
def load_k_t(k_cache_ptr: tl.tensor, slots: tl.tensor, key_ok: tl.tensor, kv_head: tl.tensor, stride_slot: int,
             stride_head: int, dims: tl.tensor, dim_ok: tl.tensor) -> tl.tensor:
    """K of one tile, transposed for q @ k: [BLOCK_D, BLOCK_N] in the cache's dtype, zero where masked."""
    ptrs = k_cache_ptr + slots[None, :] * stride_slot + kv_head * stride_head + dims[:, None]
    return tl.load(ptrs, mask=key_ok[None, :] & dim_ok[:, None], other=0.0)


@triton.jit
def load_v(v_cache_ptr: tl.tensor, slots: tl.tensor, key_ok: tl.tensor, kv_head: tl.tensor, stride_slot: int,
           stride_head: int, dims: tl.tensor, dim_ok: tl.tensor) -> tl.tensor:
    """V of one tile: [BLOCK_N, BLOCK_D] in the cache's dtype, zero where masked."""
    ptrs = v_cache_ptr + slots[:, None] * stride_slot + kv_head * stride_head + dims[None, :]
    return tl.load(ptrs, mask=key_ok[:, None] & dim_ok[None, :], other=0.0)


@triton.jit
def mma(a: tl.tensor, b: tl.tensor, IS_FP32: tl.constexpr, EMULATE_BF16: tl.constexpr) -> tl.tensor:
    """a @ b accumulated in float32, both operands already in the cache's dtype.

    A float32 cache asks for IEEE products: the default TF32 would round every operand to 10
    mantissa bits, far from the float32 the engine's other paths compute. A bfloat16 cache runs
    bf16 x bf16 -> fp32 on tensor cores. EMULATE_BF16 (set only under Triton's interpreter, whose
    dot multiplies a bfloat16 tensor's raw uint16 bits) widens the bf16 operands first: their
    products are exact in float32, so the result is what the tensor cores compute, up to the
    order of the sums."""
    if IS_FP32:
        c = tl.dot(a, b, input_precision="ieee")
    elif EMULATE_BF16:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def softmax_step(scores: tl.tensor, m_i: tl.tensor, l_i: tl.tensor, acc: tl.tensor, v: tl.tensor,
                 IS_FP32: tl.constexpr, EMULATE_BF16: tl.constexpr) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """Folds one key tile into each row's running max m_i ([M], log2 units), sum l_i ([M]) and
    unnormalised output acc ([M, BLOCK_D]). scores: [M, BLOCK_N], -inf where masked; v: [BLOCK_N, BLOCK_D]."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    # A row that has seen only masked keys keeps m = -inf; exp2(-inf - -inf) would be NaN, so
    # such a row subtracts 0 instead (its p and alpha are 0 either way).
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(scores - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # P is rounded to V's dtype for the second product, as flash attention does
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, IS_FP32, EMULATE_BF16)
    return m_new, l_i, acc


@triton.jit
def fold_sink(m_i: tl.tensor, l_i: tl.tensor, acc: tl.tensor, sink: tl.tensor) -> tuple[tl.tensor, tl.tensor]:
    """A sink logit per row ([M], log2 units: gpt-oss) joins each row's denominator with no value:
    -> l_i and acc relative to max(m_i, sink), so acc / l_i is the output with the sink's share left out."""
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_new)  # 0 for a row that saw no key (m_i = -inf)
    return l_i * alpha + tl.exp2(sink - m_new), acc * alpha[:, None]
