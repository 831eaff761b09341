"""Attention sinks (gpt-oss: a learned logit per query head in each softmax's denominator, with no
value) in every CPU attention path: the torch reference's decode and prefill, and the C++ decode
and prefill kernels on every SIMD path this CPU runs, against a dense float64 reference; and a
model without sinks is unchanged by the new argument. The sinks here are large enough that
dropping them moves the output far past the tolerances (checked)."""
from __future__ import annotations

import pytest
import torch

from engine.execution.attention import AttentionMetadata, PrefillSeqMeta
from engine.execution.backends.cpu_attention import CpuAttention
from engine.execution.backends.torch_attention import TorchAttention
from engine.execution.kernels import load_cpu_kernels

HEADS, KV_HEADS = 8, 2


def _sinks(seed: int) -> torch.Tensor:
    """[H] logits around the scores' scale: some heads give the sink most of the weight, some little."""
    return torch.randn(HEADS, generator=torch.Generator().manual_seed(seed)) * 2.0 + 1.0


def _dense(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, num_cached: int, window: int | None,
           sinks: torch.Tensor | None) -> torch.Tensor:
    """q [n, H, D] at positions num_cached.. over k/v [ctx, KVH, D] in float64, the sink logit as
    one more column of each row's softmax whose value is zero -> [n, H, D] float64."""
    n, heads, dim = q.shape
    group = heads // k_ctx.shape[1]
    k = k_ctx.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, ctx, D]
    v = v_ctx.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) * dim**-0.5  # [H, n, ctx]
    rows = torch.arange(n).unsqueeze(1) + num_cached
    cols = torch.arange(k_ctx.shape[0]).unsqueeze(0)
    visible = cols <= rows
    if window is not None:
        visible &= cols > rows - window
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks.double().view(heads, 1, 1).expand(heads, n, 1)), dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., : k_ctx.shape[0]]
    return (probs @ v).transpose(0, 1)


def _decode_case(dim: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    bs, blocks = 4, 48
    k = torch.randn(blocks * bs, KV_HEADS, dim, generator=gen).to(dtype)
    v = torch.randn(blocks * bs, KV_HEADS, dim, generator=gen).to(dtype)
    q = torch.randn(4, HEADS, dim, generator=gen).to(dtype)
    tables = torch.randperm(blocks, generator=gen)[: 4 * 10].view(4, 10)
    lens = torch.tensor([1, 5, 17, 40])
    return q, k, v, tables, lens, bs


def _decode_expected(q, k, v, tables, lens, bs, window, sinks) -> torch.Tensor:
    outs = []
    for b in range(q.shape[0]):
        slots = (tables[b, :, None] * bs + torch.arange(bs)).flatten()[: lens[b]]
        outs.append(_dense(q[b : b + 1], k[slots], v[slots], int(lens[b]) - 1, window, sinks)[0])
    return torch.stack(outs)


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


def _kernels():
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.fail("the C++ kernels must build here (make test installs a compiler)")
    return kernels


def test_dropping_the_sinks_moves_the_output_past_every_tolerance() -> None:
    """What makes the tests below able to fail: the sinks take a large share of the weight."""
    q, k, v, tables, lens, bs = _decode_case(16, torch.float32)
    with_sinks = _decode_expected(q, k, v, tables, lens, bs, None, _sinks(0))
    without = _decode_expected(q, k, v, tables, lens, bs, None, None)
    assert (with_sinks - without).abs().max() > 0.1


@pytest.mark.parametrize("window", [None, 7], ids=["full", "window7"])
def test_torch_decode_with_sinks_matches_dense(window: int | None) -> None:
    q, k, v, tables, lens, bs = _decode_case(16, torch.float32)
    attn = AttentionMetadata(slot_mapping=torch.zeros(1, dtype=torch.long), block_size=bs)
    TorchAttention().prepare_decode(attn, tables, lens)
    out = TorchAttention().decode(q, k, v, attn, 16**-0.5, window, _sinks(1))
    torch.testing.assert_close(out.double(), _decode_expected(q, k, v, tables, lens, bs, window, _sinks(1)),
                               atol=1e-5, rtol=1e-5)


# Head sizes: 16 (one vector), 64 (bf16 rows split into even and odd columns), 80 (64 + 16).
@pytest.mark.parametrize("dim", [16, 64, 80])
@pytest.mark.parametrize("window", [None, 7], ids=["full", "window7"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpp_decode_with_sinks_matches_dense(dim: int, window: int | None, dtype: torch.dtype) -> None:
    kernels = _kernels()
    q, k, v, tables, lens, bs = _decode_case(dim, dtype, seed=dim)
    sinks = _sinks(dim)
    expected = _decode_expected(q, k, v, tables, lens, bs, window, sinks)
    for isa in range(kernels.best_isa() + 1):
        attn = AttentionMetadata(slot_mapping=torch.zeros(1, dtype=torch.long), block_size=bs, block_tables=tables,
                                 context_lens=lens)
        out = CpuAttention(kernels, isa, prefill_in_cpp=False).decode(q, k, v, attn, dim**-0.5, window, sinks)
        torch.testing.assert_close(out.double(), expected, **_tol(dtype), msg=lambda m, isa=isa: f"isa {isa}: {m}")


def test_cpp_decode_without_sinks_is_unchanged() -> None:
    """None (every family but gpt-oss) gives what the kernel gave before: the plain softmax, bit for bit
    against the same call with the argument left out."""
    kernels = _kernels()
    q, k, v, tables, lens, bs = _decode_case(64, torch.float32, seed=3)
    for isa in range(kernels.best_isa() + 1):
        a = kernels.paged_decode_attention(q, k, v, tables, lens, bs, 0.125, 0, isa)
        b = kernels.paged_decode_attention(q, k, v, tables, lens, bs, 0.125, 0, isa, None)
        assert torch.equal(a, b)
        torch.testing.assert_close(a.double(), _decode_expected(q, k, v, tables, lens, bs, None, None),
                                   atol=1e-5, rtol=1e-5)


def _prefill_case(dim: int, dtype: torch.dtype, bs: int, seed: int):
    """Three chunks packed in one step: a whole prompt, a chunk after 50 cached tokens (scattered
    blocks), a one-token chunk. -> q (a strided slice, as the fused QKV output hands it over),
    caches, block tables, metas, chunks."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 64
    k_cache = torch.randn(num_blocks * bs, KV_HEADS, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks * bs, KV_HEADS, dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: 3 * (80 // bs)].view(3, 80 // bs)
    chunks = [(0, 37), (50, 29), (11, 1)]
    metas, start = [], 0
    for (cached, n), table in zip(chunks, tables, strict=True):
        positions = torch.arange(cached + n)
        slots = table[positions // bs] * bs + positions % bs
        metas.append(PrefillSeqMeta(start, n, cached + n, slots, block_table=table))
        start += n
    q = torch.randn(start, HEADS + 2 * KV_HEADS, dim, generator=gen).to(dtype)[:, :HEADS]
    return q, k_cache, v_cache, tables, metas, chunks


@pytest.mark.parametrize("dim", [64, 24], ids=["D64", "D24-portable"])
@pytest.mark.parametrize("window", [None, 21], ids=["full", "window21"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bs", [4, 16], ids=["bs4", "bs16"])
def test_prefill_with_sinks_matches_dense(dim: int, window: int | None, dtype: torch.dtype, bs: int) -> None:
    """The C++ prefill kernel on every SIMD path (AVX-512 tiles in log2 units, the portable loop
    in natural ones; D = 24 takes the portable loop everywhere) and torch's reference."""
    kernels = _kernels()
    q, k_cache, v_cache, tables, metas, chunks = _prefill_case(dim, dtype, bs, seed=dim + bs)
    sinks = _sinks(dim + bs)
    num_tokens = q.shape[0]
    backends = [(f"isa {isa}", CpuAttention(kernels, isa, prefill_in_cpp=True)) for isa in range(kernels.best_isa() + 1)]
    backends.append(("torch", TorchAttention()))
    for name, backend in backends:
        attn = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.int64), num_prefill_tokens=num_tokens,
                                 prefill=metas, block_size=bs)
        k_new = torch.cat([k_cache[m.context_slots[m.num_cached_tokens:]] for m in metas])  # the chunks' own K/V
        v_new = torch.cat([v_cache[m.context_slots[m.num_cached_tokens:]] for m in metas])
        out = backend.prefill(q, k_new, v_new, k_cache, v_cache, attn, dim**-0.5, window, sinks)
        for (cached, n), meta in zip(chunks, metas, strict=True):
            rows = slice(meta.query_start, meta.query_start + n)
            expected = _dense(q[rows], k_cache[meta.context_slots], v_cache[meta.context_slots], cached, window, sinks)
            torch.testing.assert_close(out[rows].double(), expected, **_tol(dtype),
                                       msg=lambda m, name=name, n=n: f"{name}, chunk of {n}: {m}")


def test_cpp_prefill_with_sinks_over_rising_scores() -> None:
    """A long context whose scores rise far past the AVX-512 tiles' running maximum (kept until a
    score passes it by 2^8) and a sink above and below them: the sink joins the sum relative to
    whichever is larger, without overflow."""
    kernels = _kernels()
    gen = torch.Generator().manual_seed(11)
    dim, bs, n = 64, 16, 300
    k_cache = torch.randn(n, KV_HEADS, dim, generator=gen)
    v_cache = torch.randn(n, KV_HEADS, dim, generator=gen)
    k_cache[:, 0] *= torch.linspace(0.1, 6.0, n).view(n, 1)  # head 0's scores grow along the context
    q = torch.randn(n, HEADS, dim, generator=gen)
    table = torch.arange(n // bs + 1)
    sinks = torch.tensor([80.0, -80.0, 0.0, 5.0, 30.0, -5.0, 1.0, 60.0])
    metas = [PrefillSeqMeta(0, n, n, None, block_table=table)]
    expected = _dense(q, k_cache, v_cache, 0, None, sinks)
    for isa in range(kernels.best_isa() + 1):
        attn = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.int64), num_prefill_tokens=n, prefill=metas,
                                 block_size=bs)
        out = CpuAttention(kernels, isa, prefill_in_cpp=True).prefill(q, k_cache, v_cache, k_cache, v_cache, attn,
                                                                      dim**-0.5, None, sinks)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-4, msg=lambda m, isa=isa: f"isa {isa}: {m}")
