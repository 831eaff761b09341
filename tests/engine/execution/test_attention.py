"""Attention agrees with dense attention: the C++ paged decode kernel, the pure-torch decode path,
and every prefill path (fresh, after a cached context read in place or gathered, sliding window)."""
from __future__ import annotations

import pytest
import torch

from engine.execution.attention import AttentionMetadata, PrefillSeqMeta
from engine.execution.backends.cpu_attention import CpuAttention
from engine.execution.backends.torch_attention import TorchAttention, gathered_decode_attention
from engine.execution.kernels import load_cpu_kernels


def _case(seed: int = 0, dim: int = 16):
    gen = torch.Generator().manual_seed(seed)
    batch, heads, kv_heads, bs, blocks = 5, 9, 3, 4, 40
    k = torch.randn(blocks * bs, kv_heads, dim, generator=gen)
    v = torch.randn(blocks * bs, kv_heads, dim, generator=gen)
    q = torch.randn(batch, heads, dim, generator=gen)
    tables = torch.randperm(blocks, generator=gen)[: batch * 6].view(batch, 6)
    lens = torch.tensor([1, 4, 5, 17, 24])
    return q, k, v, tables, lens, bs


def _dense(q, k, v, tables, lens, bs, window=None):
    outs = []
    for b in range(q.shape[0]):
        slots = (tables[b, :, None] * bs + torch.arange(bs)).flatten()[: lens[b]]
        if window is not None:
            slots = slots[-window:]  # the last `window` tokens
        kb = k[slots].repeat_interleave(3, dim=1).transpose(0, 1)  # [H, L, D]
        vb = v[slots].repeat_interleave(3, dim=1).transpose(0, 1)
        probs = torch.softmax(q[b].unsqueeze(1) @ kb.transpose(1, 2) * q.shape[-1] ** -0.5, dim=-1)
        outs.append((probs @ vb).squeeze(1))
    return torch.stack(outs)


def test_torch_decode_path_matches_dense() -> None:
    q, k, v, tables, lens, bs = _case()
    slots = (tables[:, :, None] * bs + torch.arange(bs)).reshape(q.shape[0], -1)
    mask = torch.where(torch.arange(slots.shape[1]) < lens[:, None], 0.0, -float("inf")).view(q.shape[0], 1, 1, -1)
    out = gathered_decode_attention(q, k, v, slots, mask, q.shape[-1] ** -0.5)
    torch.testing.assert_close(out, _dense(q, k, v, tables, lens, bs))


# Head sizes: 16 (one vector), 80 (64 columns in registers, then 16 more); lengths from 1 to 24
# (a partial and a full 16-token score block), with and without a sliding window. Every SIMD
# path this CPU runs.
@pytest.mark.parametrize("dim", [16, 80])
@pytest.mark.parametrize("window", [None, 7])
def test_cpp_kernel_matches_dense(dim: int, window: int | None) -> None:
    kernels = load_cpu_kernels()
    assert kernels is not None, "the C++ kernel must build here (gcc and torch headers are installed)"
    q, k, v, tables, lens, bs = _case(1, dim)
    expected = _dense(q, k, v, tables, lens, bs, window)
    for isa in range(kernels.best_isa() + 1):
        attn = AttentionMetadata(slot_mapping=torch.zeros(1, dtype=torch.long), block_size=bs, block_tables=tables,
                                 context_lens=lens)
        out = CpuAttention(kernels, isa, prefill_in_cpp=False).decode(q, k, v, attn, q.shape[-1] ** -0.5, window)
        torch.testing.assert_close(out, expected, msg=lambda m, isa=isa: f"isa {isa}: {m}")


# Head sizes 64 and 96 read each bfloat16 row 32 values at a time, split into even and odd
# columns (96: 64 columns, then 32); 16 and 80 widen 16 at a time.
@pytest.mark.parametrize("dim", [16, 64, 80, 96])
def test_cpp_kernel_bfloat16_cache(dim: int) -> None:
    kernels = load_cpu_kernels()
    assert kernels is not None
    q, k, v, tables, lens, bs = _case(2, dim)
    ref = _dense(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), tables, lens, bs)
    for isa in range(kernels.best_isa() + 1):
        attn = AttentionMetadata(slot_mapping=torch.zeros(1, dtype=torch.long), block_size=bs, block_tables=tables,
                                 context_lens=lens)
        out = CpuAttention(kernels, isa, prefill_in_cpp=False).decode(q.bfloat16(), k.bfloat16(), v.bfloat16(), attn,
                                                                      q.shape[-1] ** -0.5, None)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2, msg=lambda m, isa=isa: f"isa {isa}: {m}")


def _dense_prefill(q, k_ctx, v_ctx, num_cached, window=None):
    """Reference: q [n, H, D] over k/v [ctx, KVH, D], causal from position num_cached on."""
    n, heads, dim = q.shape
    group = heads // k_ctx.shape[1]
    k = k_ctx.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, ctx, D]
    v = v_ctx.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) * dim**-0.5  # [H, n, ctx]
    rows = torch.arange(n).unsqueeze(1) + num_cached
    cols = torch.arange(k_ctx.shape[0]).unsqueeze(0)
    allowed = cols <= rows
    if window is not None:
        allowed &= cols > rows - window
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return (probs @ v).transpose(0, 1)


@pytest.mark.parametrize("num_cached", [0, 7, 40])
@pytest.mark.parametrize("consecutive", [True, False])
@pytest.mark.parametrize("window", [None, 9])
def test_prefill_attention_matches_dense(num_cached: int, consecutive: bool, window: int | None) -> None:
    gen = torch.Generator().manual_seed(num_cached)
    heads, kv_heads, dim, n, num_slots = 9, 3, 16, 13, 128
    k_cache = torch.randn(num_slots, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_slots, kv_heads, dim, generator=gen)
    # Two sequences packed: one with nothing cached, one with num_cached cached tokens.
    q = torch.randn(2 * n, heads, dim, generator=gen)
    k = torch.randn(2 * n, kv_heads, dim, generator=gen)
    v = torch.randn(2 * n, kv_heads, dim, generator=gen)
    ctx = num_cached + n
    slots = torch.arange(20, 20 + ctx) if consecutive else torch.randperm(num_slots, generator=gen)[:ctx]
    k_cache[slots[num_cached:]], v_cache[slots[num_cached:]] = k[n:], v[n:]  # write_kv's job
    metas = [PrefillSeqMeta(0, n, n, None),
             PrefillSeqMeta(n, n, ctx, slots if num_cached else None,
                            int(slots[0]) if consecutive and num_cached else None)]
    attn = AttentionMetadata(slot_mapping=slots[num_cached:], num_prefill_tokens=2 * n, prefill=metas)
    out = TorchAttention().prefill(q, k, v, k_cache, v_cache, attn, dim**-0.5, window)
    torch.testing.assert_close(out[:n], _dense_prefill(q[:n], k[:n], v[:n], 0, window))
    torch.testing.assert_close(out[n:], _dense_prefill(q[n:], k_cache[slots], v_cache[slots], num_cached, window))


def test_runner_reads_the_cache_in_place_only_for_consecutive_slots(tiny_llm) -> None:
    """Block tables like [6, 5, 7, 9] span as many slots as a consecutive run but are not one
    (the torch prefill path; the C++ kernel gets the block table instead, and nothing else)."""
    from engine.execution.input_batch import Chunk, prepare_prefill
    runner = tiny_llm.engine.runner
    bs = runner.block_size

    def chunk_meta(table: list[int], with_block_tables: bool) -> PrefillSeqMeta:
        chunk = Chunk(list(range(bs)), 4 * bs, [list(table)])  # a last chunk of bs tokens after 4 blocks cached
        return prepare_prefill([chunk], bs, runner._to_device, with_block_tables).metas[0]

    meta = chunk_meta([6, 5, 7, 9, 10], with_block_tables=True)
    assert meta.block_table.tolist() == [6, 5, 7, 9, 10] and meta.context_slots is None
    cases = {(6, 5, 7, 9, 10): False, (3, 4, 5, 6, 7): True, (9, 8, 7, 6, 5): False}
    for table, in_place in cases.items():
        assert (chunk_meta(list(table), with_block_tables=False).cached_slot_start is not None) == in_place, table


def test_packed_chunks_map_each_token_to_its_slot_either_way() -> None:
    """Positions and slots of packed chunks (a whole prompt, a chunk after a cached context, a
    verification of 3 tokens at a long context) are the same whether the kernel reads by block
    table (only the chunks' own slots mapped) or torch reads the context by slot."""
    from engine.execution.input_batch import Chunk, prepare_prefill
    bs = 4
    chunks = [Chunk([1, 2, 3, 4, 5], 0, [[7, 2]]), Chunk(list(range(6)), 9, [[3, 8, 1, 0, 4]]),
              Chunk([9, 9, 9], 37, [[11 + i for i in range(10)]])]
    expected_positions = list(range(5)) + list(range(9, 15)) + [37, 38, 39]
    expected_slots = ([7 * bs + p for p in range(4)] + [2 * bs] + [1 * bs + 1, 1 * bs + 2, 1 * bs + 3]
                      + [0 * bs + p for p in range(3)] + [(11 + 9) * bs + p for p in (1, 2, 3)])
    for with_block_tables in (True, False):
        inputs = prepare_prefill(chunks, bs, torch.as_tensor, with_block_tables)
        assert inputs.positions.tolist() == expected_positions
        assert inputs.slot_mapping.tolist() == expected_slots
        assert inputs.last_indices == [4, 10, 13]
        assert [m.context_len for m in inputs.metas] == [5, 15, 40]


def test_bfloat16_chunk_after_a_cached_context_matches_dense() -> None:
    """The log-sum-exp merge in bfloat16 (the flash kernel's lse is float32 whatever the input)."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, n, num_cached = 9, 3, 16, 13, 24
    k_cache, v_cache = (torch.randn(64, kv_heads, dim, generator=gen).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(n, heads, dim, generator=gen).to(torch.bfloat16)
    slots = torch.arange(8, 8 + num_cached + n)
    k, v = k_cache[slots[num_cached:]], v_cache[slots[num_cached:]]
    meta = PrefillSeqMeta(0, n, num_cached + n, slots, 8)
    attn = AttentionMetadata(slot_mapping=slots[num_cached:], num_prefill_tokens=n, prefill=[meta])
    out = TorchAttention().prefill(q, k, v, k_cache, v_cache, attn, dim**-0.5, None)
    assert out.dtype == torch.bfloat16
    expected = _dense_prefill(q.float(), k_cache[slots].float(), v_cache[slots].float(), num_cached)
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dim", [64, 16, 24], ids=["D64", "D16", "D24-portable"])
@pytest.mark.parametrize("window", [None, 21], ids=["full", "window21"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bs", [4, 16], ids=["bs4", "bs16"])
def test_cpp_prefill_kernel_matches_dense(dim: int, window: int | None, dtype: torch.dtype, bs: int) -> None:
    """The C++ prefill kernel through prefill_attention, on every SIMD path the CPU has: a whole
    prompt, a chunk after a cached context (scattered blocks), and a one-token chunk, packed in one
    step; 9 query heads on 3 KV heads (tiles of 2 tokens) and 4 on 4 (tiles of 8), so full and
    partial tiles and several tiles per task all run; D = 24 takes the portable loop everywhere.
    Blocks of 16 tokens let the AVX-512 tiles read a float32 cache's values in place (where the
    first visible key starts a 16-key block: not after the window's start at 50 cached); blocks
    of 4 take the chunk's copy of them."""
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.fail("the C++ kernels must build here (make test installs a compiler)")
    for heads, kv_heads in [(9, 3), (4, 4)]:
        gen = torch.Generator().manual_seed(dim + heads)
        num_blocks = 64
        k_cache = torch.randn(num_blocks * bs, kv_heads, dim, generator=gen).to(dtype)
        v_cache = torch.randn(num_blocks * bs, kv_heads, dim, generator=gen).to(dtype)
        tables = torch.randperm(num_blocks, generator=gen)[: 3 * (80 // bs)].view(3, 80 // bs)  # 80 tokens each
        chunks = [(0, 37), (50, 29), (11, 1)]  # (cached tokens, new tokens) per sequence
        metas, start = [], 0
        for (cached, n), table in zip(chunks, tables, strict=True):
            metas.append(PrefillSeqMeta(start, n, cached + n, None, block_table=table))
            start += n
        # A slice of a fused QKV output, as the model hands it over: strided rows, read in place.
        q = torch.randn(start, heads + 2 * kv_heads, dim, generator=gen).to(dtype)[:, :heads]
        for isa in range(kernels.best_isa() + 1):
            attn = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.int64), num_prefill_tokens=start,
                                     prefill=metas, block_size=bs)
            cpp = CpuAttention(kernels, isa, prefill_in_cpp=True)
            out = cpp.prefill(q, q[:, :kv_heads], q[:, :kv_heads], k_cache, v_cache, attn, dim**-0.5, window)
            assert out.dtype == dtype
            for (cached, n), meta, table in zip(chunks, metas, tables, strict=True):
                positions = torch.arange(cached + n)
                slots = table[positions // bs] * bs + positions % bs
                rows = slice(meta.query_start, meta.query_start + n)
                expected = _dense_prefill(q[rows].double(), k_cache[slots].double(), v_cache[slots].double(), cached,
                                          window)
                tol = 1e-5 if dtype == torch.float32 else 2e-2
                torch.testing.assert_close(out[rows].double(), expected, atol=tol, rtol=tol,
                                           msg=lambda m, isa=isa, n=n: f"isa {isa}, chunk of {n}: {m}")
                # The same chunk alone in its step (its rows at 0 of their own output) agrees.
                alone = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.int64), num_prefill_tokens=n,
                                          prefill=[PrefillSeqMeta(0, n, cached + n, None, block_table=table)],
                                          block_size=bs)
                out_alone = cpp.prefill(q[rows], q[rows, :kv_heads], q[rows, :kv_heads], k_cache, v_cache,
                                        alone, dim**-0.5, window)
                torch.testing.assert_close(out_alone, out[rows], atol=0, rtol=0)


@pytest.mark.parametrize("window", [None, 150], ids=["full", "window150"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dim", [64, 32], ids=["D64", "D32"])
def test_cpp_prefill_kernel_rescales_rows_whose_scores_rise(window: int | None, dtype: torch.dtype, dim: int) -> None:
    """Long contexts, where the AVX-512 kernel keeps a row's maximum until a score passes it by
    more than 2^8: on KV head 0 one key scores 2^43 to 2^374 times the rest (past 2^128 its
    probability overflows float32 without a rescale); on head 1 the keys' scores rise through the
    context, every 64-key step's best by up to 2^6.4 over the row's maximum (probabilities above
    1 against a kept maximum); head 2 is plain. A chunk after 300 cached tokens and a whole
    340-token prompt, on every SIMD path, against dense float64; a bfloat16 cache (from
    AVX512-BF16 up: q and p rounded to bfloat16, the products on vdpbf16ps) within bf16's
    tolerance of dense attention over the same rounded K and V."""
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.fail("the C++ kernels must build here (make test installs a compiler)")
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, bs, num_ctx = 9, 3, 16, 340
    q_all = torch.randn(num_ctx, heads, dim, generator=gen) + 0.5  # positive mean: a key of ones scores high
    k_cache = torch.randn(num_ctx, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_ctx, kv_heads, dim, generator=gen)
    k_cache[200, 0] = 40.0 * (64 / dim) ** 0.5  # the same scores at head_dim 32
    k_cache[:, 1] += torch.linspace(0.0, 1.5 * (64 / dim) ** 0.5, num_ctx).unsqueeze(1)
    table = torch.randperm(num_ctx // bs + 1, generator=gen)
    slots = table[torch.arange(num_ctx) // bs] * bs + torch.arange(num_ctx) % bs
    k_paged = torch.zeros(table.numel() * bs, kv_heads, dim)
    v_paged = torch.zeros_like(k_paged)
    k_paged[slots], v_paged[slots] = k_cache, v_cache
    k_paged, v_paged = k_paged.to(dtype), v_paged.to(dtype)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for cached in (300, 0):
        n = num_ctx - cached
        q = q_all[cached:]
        expected = _dense_prefill(q.double(), k_cache.double(), v_cache.double(), cached, window)
        for isa in range(kernels.best_isa() + 1):
            attn = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.int64), num_prefill_tokens=n,
                                     prefill=[PrefillSeqMeta(0, n, num_ctx, None, block_table=table)],
                                     block_size=bs)
            out = CpuAttention(kernels, isa, prefill_in_cpp=True).prefill(q, q[:, :kv_heads], q[:, :kv_heads], k_paged,
                                                                           v_paged, attn, dim**-0.5, window)
            torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol,
                                       msg=lambda m, isa=isa, cached=cached: f"isa {isa}, {cached} cached: {m}")


@pytest.mark.parametrize("window", [None, 100], ids=["full", "window100"])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (12, 12, 32), (8, 2, 128), (4, 4, 96)],
                         ids=["9x3-D64", "12x12-D32", "8x2-D128", "4x4-D96"])
def test_amx_prefill_attention_matches_dense_and_the_pair_path(window: int | None, heads: int, kv_heads: int,
                                                                dim: int) -> None:
    """A bfloat16 cache's prefill on the AMX tiles (16 query rows a tile, rows across tokens; both
    products tile products; one zero block of values after the last for P V's 32-key chunks; o
    held in the tile registers over 32-key steps at head_dim 32 and 64, stored each step at larger
    ones):
    a 300-token chunk after 211 cached tokens (a context ending mid-block), against dense float64
    over the same bfloat16 K and V, and against the vdpbf16ps pair path it replaces (the same
    roundings of q and p, another order of sums). Skipped, saying so, on a CPU without AMX."""
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.fail("the C++ kernels must build here (make test installs a compiler)")
    if kernels.best_isa() < 4:
        pytest.skip("this CPU has no AMX (or the kernel gave no leave to use it): the AMX path cannot run here")
    gen = torch.Generator().manual_seed(dim + heads)
    bs, cached, n = 16, 211, 300
    num_ctx = cached + n
    table = torch.randperm(num_ctx // bs + 2, generator=gen)
    k_cache = torch.randn(table.numel() * bs, kv_heads, dim, generator=gen).bfloat16()
    v_cache = torch.randn(table.numel() * bs, kv_heads, dim, generator=gen).bfloat16()
    q = torch.randn(n, heads, dim, generator=gen)
    positions = torch.arange(num_ctx)
    slots = table[positions // bs] * bs + positions % bs
    attn = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.int64), num_prefill_tokens=n,
                             prefill=[PrefillSeqMeta(0, n, num_ctx, None, block_table=table)], block_size=bs)
    outs = {isa: CpuAttention(kernels, isa, prefill_in_cpp=True).prefill(q, q[:, :kv_heads], q[:, :kv_heads], k_cache,
                                                                          v_cache, attn, dim**-0.5, window)
            for isa in (3, 4)}
    expected = _dense_prefill(q.double(), k_cache[slots].double(), v_cache[slots].double(), cached, window)
    torch.testing.assert_close(outs[4].double(), expected, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(outs[4], outs[3], atol=1e-2, rtol=1e-2)
    assert not torch.equal(outs[4], outs[3]), "the AMX path did not run (its sums' order differs from the pair path's)"


@pytest.mark.parametrize("window", [None, 21], ids=["full", "window21"])
@pytest.mark.parametrize("dim", [32, 64])
def test_amx_prefill_over_scores_past_the_plain_softmax_takes_the_shifted_one(window: int | None, dim: int) -> None:
    """A bfloat16 cache's causal (and windowed) prefill on the AMX tiles where each query scores
    its own key a few hundred log2 units above every other (2^s overflows: the tiles run again
    with each row's maximum; the softmax is one-hot, each out its own position's v), against
    float64. Skipped, saying so, on a CPU without AMX."""
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.fail("the C++ kernels must build here (make test installs a compiler)")
    if kernels.best_isa() < 4:
        pytest.skip("this CPU has no AMX (or the kernel gave no leave to use it): the AMX path cannot run here")
    gen = torch.Generator().manual_seed(dim)
    kv_heads = 2
    bs, cached, n = 16, 37, 90
    num_ctx = cached + n
    table = torch.randperm(num_ctx // bs + 2, generator=gen)
    k_ctx = torch.randn(num_ctx, kv_heads, dim, generator=gen)
    k_ctx /= k_ctx.norm(dim=-1, keepdim=True)
    v_ctx = torch.randn(num_ctx, kv_heads, dim, generator=gen).bfloat16()
    k_ctx = k_ctx.bfloat16()
    positions = torch.arange(num_ctx)
    slots = table[positions // bs] * bs + positions % bs
    k_cache = torch.zeros(table.numel() * bs, kv_heads, dim, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    k_cache[slots], v_cache[slots] = k_ctx, v_ctx
    q = 300 * dim**0.5 * k_ctx[cached:].float()  # its own key's score 300 (about 430 log2 units)
    attn = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.int64), num_prefill_tokens=n,
                             prefill=[PrefillSeqMeta(0, n, num_ctx, None, block_table=table)], block_size=bs)
    out = CpuAttention(kernels, 4, prefill_in_cpp=True).prefill(q, q, q, k_cache, v_cache, attn, dim**-0.5, window)
    expected = _dense_prefill(q.double(), k_ctx.double(), v_ctx.double(), cached, window)
    torch.testing.assert_close(expected, v_ctx[cached:].double(), atol=1e-6, rtol=0)
    torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=1e-2)
