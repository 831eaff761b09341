"""The encoders' attention kernel (packed_bidirectional_attention) against a dense float64
reference: each prompt of a step, packed back to back in the fused [T, q | k | v] rows, attends
to every token of its own and to none of another's, on every SIMD path this CPU runs (the
AVX-512 tiles where the head size allows, else the portable loop)."""
from __future__ import annotations

import pytest
import torch

from engine.execution.backends.cpu_attention import CpuAttention
from engine.execution.kernels import ISAS
from tests.helpers import ISA_NAMES


def _dense(qkv: torch.Tensor, starts: list[int], num_heads: int, scale: float) -> torch.Tensor:
    """[T, 3 H D] -> [T, H, D] in float64, prompt by prompt."""
    num_tokens = qkv.shape[0]
    q, k, v = qkv.double().view(num_tokens, 3, num_heads, -1).unbind(1)  # [T, H, D] each
    out = torch.empty_like(q)
    for begin, end in zip(starts[:-1], starts[1:], strict=True):
        s = torch.einsum("qhd,khd->hqk", q[begin:end], k[begin:end]) * scale
        out[begin:end] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v[begin:end])
    return out


def _packed_prompts(lengths: tuple[int, ...], num_heads: int, head_dim: int,
                    seed: int) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """A step of prompts of these lengths: qkv [T, 3 H D] with scores of a few units (so that a
    wrong key, another prompt's or another head's, moves the softmax), their starts, and the
    float64 reference."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(sum(lengths), 3 * num_heads * head_dim, generator=gen) * 1.5
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return qkv, starts, _dense(qkv, starts, num_heads, head_dim**-0.5)


# Lengths: one token; under, at and past a 16-key block; past a 64-key step and a tile task's
# 64 rows (the partial last tile); D = 32 (bge-small's), 16 and 64 on the AVX-512 tiles, 24 on
# the portable loop only.
@pytest.mark.parametrize(("lengths", "num_heads", "head_dim"),
                         [((1, 5, 16, 17, 64, 70, 131), 3, 32), ((40, 1, 9), 2, 16), ((100, 33), 2, 64),
                          ((23, 7), 2, 24)], ids=["d32", "d16", "d64", "d24"])
def test_each_prompt_attends_to_all_of_its_own_rows_only(kernels, lengths: tuple[int, ...], num_heads: int,
                                                         head_dim: int) -> None:
    qkv, starts, expected = _packed_prompts(lengths, num_heads, head_dim, sum(lengths) + head_dim)
    num_tokens, scale = qkv.shape[0], head_dim**-0.5
    query_starts = torch.tensor(starts, dtype=torch.int64)
    for isa in range(kernels.best_isa() + 1):
        out = torch.full((num_tokens, num_heads, head_dim), float("nan"))
        kernels.packed_bidirectional_attention(qkv, query_starts, num_heads, scale, isa, out)
        err = (out.double() - expected).abs().max().item()
        assert err < 1e-5, f"{ISA_NAMES[isa]}: max error {err}"


def test_a_causal_or_whole_step_attention_is_not_what_it_computes(kernels) -> None:
    """The reference itself tells the cases apart: attending across prompts, or causally within
    one, gives other values (so the test above can fail)."""
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(40, 3 * 2 * 32, generator=gen) * 1.5
    out = torch.empty(40, 2, 32)
    kernels.packed_bidirectional_attention(qkv, torch.tensor([0, 15, 40]), 2, 32**-0.5, kernels.best_isa(), out)
    per_prompt = _dense(qkv, [0, 15, 40], 2, 32**-0.5)
    whole = _dense(qkv, [0, 40], 2, 32**-0.5)
    torch.testing.assert_close(out.double(), per_prompt, atol=1e-5, rtol=1e-5)
    assert (whole - per_prompt).abs().max() > 1e-2
    q, k, v = qkv.view(40, 3, 2, 32).unbind(1)
    causal = torch.nn.functional.scaled_dot_product_attention(q[:15].transpose(0, 1), k[:15].transpose(0, 1),
                                                              v[:15].transpose(0, 1), is_causal=True).transpose(0, 1)
    assert (causal - out[:15]).abs().max() > 1e-2


def test_backend_runs_it_where_the_prefill_tiles_run(kernels) -> None:
    """CpuAttention offers the kernel with its AVX-512 prefill tiles, returns qkv's dtype, and
    rejects a malformed step by name."""
    isa = kernels.best_isa()
    attention = CpuAttention(kernels, isa, prefill_in_cpp=isa >= ISAS["avx512"])
    assert attention.has_bidirectional_kernel == (isa >= ISAS["avx512"])
    assert not CpuAttention(kernels, isa, prefill_in_cpp=False).has_bidirectional_kernel
    qkv = torch.randn(20, 3 * 4 * 16)
    out = attention.bidirectional(qkv, torch.tensor([0, 8, 20]), 4, 0.25)
    assert out.shape == (20, 4, 16) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _dense(qkv, [0, 8, 20], 4, 0.25), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="query_starts must run from 0 to T"):
        attention.bidirectional(qkv, torch.tensor([0, 8, 19]), 4, 0.25)


@pytest.mark.parametrize(("lengths", "num_heads", "head_dim"), [((1, 5, 16, 17, 70, 131), 3, 32), ((100, 33), 2, 64)],
                         ids=["d32", "d64"])
def test_bfloat16_products_round_as_a_bfloat16_cache_does(kernels, lengths: tuple[int, ...], num_heads: int,
                                                          head_dim: int) -> None:
    """bf16_products (a bfloat16 encoder on an AVX512-BF16 CPU): the pair path's vdpbf16ps tiles,
    within bfloat16's rounding of the dense reference, and not the float32 path's result."""
    if kernels.best_isa() < ISAS["avx512_bf16"]:
        pytest.skip("this CPU has no AVX512-BF16 (vdpbf16ps): the bfloat16 pair path does not run here")
    qkv, starts, expected = _packed_prompts(lengths, num_heads, head_dim, sum(lengths))
    num_tokens, scale = qkv.shape[0], head_dim**-0.5
    query_starts = torch.tensor(starts, dtype=torch.int64)
    exact = torch.empty(num_tokens, num_heads, head_dim)
    kernels.packed_bidirectional_attention(qkv, query_starts, num_heads, scale, kernels.best_isa(), exact)
    for isa in range(ISAS["avx512_bf16"], kernels.best_isa() + 1):
        out = torch.full((num_tokens, num_heads, head_dim), float("nan"))
        kernels.packed_bidirectional_attention(qkv, query_starts, num_heads, scale, isa, out, True)
        # bfloat16's 8 bits: the tolerance the bfloat16 caches' prefill is held to
        torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2, msg=ISA_NAMES[isa])
        assert (out - exact).abs().max().item() > 1e-4  # rounded: not the float32 path
    with pytest.raises(RuntimeError, match="bf16_products needs an AVX512-BF16 isa"):
        kernels.packed_bidirectional_attention(qkv, query_starts, num_heads, scale, ISAS["avx512"], exact, True)


def test_a_bfloat16_backend_runs_bfloat16_products_where_they_run(kernels) -> None:
    """CpuAttention of a bfloat16 model multiplies in bfloat16 where vdpbf16ps runs (its output
    within bfloat16's tolerance, not the float32 one), a float32 model's never."""
    isa = kernels.best_isa()
    bf16 = CpuAttention(kernels, isa, prefill_in_cpp=True, is_bfloat16=True)
    fp32 = CpuAttention(kernels, isa, prefill_in_cpp=True)
    assert bf16.is_bf16_bidirectional == (isa >= ISAS["avx512_bf16"]) and not fp32.is_bf16_bidirectional
    qkv, start_list, expected = _packed_prompts((15, 25), 2, 32, 3)
    starts = torch.tensor(start_list)
    exact = fp32.bidirectional(qkv, starts, 2, 32**-0.5)
    torch.testing.assert_close(exact.double(), expected, atol=1e-5, rtol=1e-5)
    rounded = bf16.bidirectional(qkv, starts, 2, 32**-0.5)
    torch.testing.assert_close(rounded.double(), expected, atol=2e-2, rtol=2e-2)
    assert ((rounded - exact).abs().max() > 1e-4) == bf16.is_bf16_bidirectional


def test_bfloat16_qkv_gives_what_its_float_values_give(kernels) -> None:
    """A bfloat16 qkv (the fused QKV's rounded output, on AMX) with bf16_products: K and V read in
    place, q widened, the same bits as the same values in float32; without bf16_products it is
    refused by name."""
    if kernels.best_isa() < ISAS["avx512_bf16"]:
        pytest.skip("this CPU has no AVX512-BF16 (vdpbf16ps): the bfloat16 pair path does not run here")
    qkv, start_list, _ = _packed_prompts((1, 17, 40, 70), 3, 32, 5)
    qkv = qkv.bfloat16()
    starts = torch.tensor(start_list, dtype=torch.int64)
    num_tokens = qkv.shape[0]
    for isa in range(ISAS["avx512_bf16"], kernels.best_isa() + 1):
        from_bf16, from_float = torch.empty(num_tokens, 3, 32), torch.empty(num_tokens, 3, 32)
        kernels.packed_bidirectional_attention(qkv, starts, 3, 32**-0.5, isa, from_bf16, True)
        kernels.packed_bidirectional_attention(qkv.float(), starts, 3, 32**-0.5, isa, from_float, True)
        assert torch.equal(from_bf16, from_float), ISA_NAMES[isa]
    with pytest.raises(RuntimeError, match="qkv must be float32"):
        kernels.packed_bidirectional_attention(qkv, starts, 3, 32**-0.5, kernels.best_isa(), from_bf16)


def test_prompts_handed_out_whole_give_the_bits_of_prompts_split(kernels) -> None:
    """A step of at least 2 prompts a thread runs each prompt whole on one thread; with one thread
    each prompt is split over the (one) thread as before: the same bits either way, float32 and
    bfloat16 products."""
    qkv, start_list, _ = _packed_prompts((0, 300, 1, 17, 40, 5, 70, 33, 64), 3, 32, 9)
    starts = torch.tensor(start_list, dtype=torch.int64)
    num_tokens, isa = qkv.shape[0], kernels.best_isa()
    modes = [(qkv, False)] + ([(qkv, True), (qkv.bfloat16(), True)] if isa >= ISAS["avx512_bf16"] else [])
    threads = torch.get_num_threads()
    try:
        for given, bf16_products in modes:
            outs = []
            for num_threads in (1, 2, 3):
                torch.set_num_threads(num_threads)
                out = torch.empty(num_tokens, 3, 32)
                kernels.packed_bidirectional_attention(given, starts, 3, 32**-0.5, isa, out, bf16_products)
                outs.append(out)
            assert all(torch.equal(outs[0], o) for o in outs[1:]), f"{given.dtype} bf16_products={bf16_products}"
    finally:
        torch.set_num_threads(threads)


def test_bfloat16_out_is_the_float_out_rounded(kernels) -> None:
    """With bf16_products a bfloat16 out gets the float32 out's rows rounded to nearest-even (the
    kernel rounds each prompt's rows itself), whether the prompts run whole on a thread or split;
    a bfloat16 out without bf16_products is refused by name."""
    if kernels.best_isa() < ISAS["avx512_bf16"]:
        pytest.skip("this CPU has no AVX512-BF16 (vdpbf16ps): the bfloat16 pair path does not run here")
    qkv, start_list, _ = _packed_prompts((0, 300, 1, 17, 40, 5, 70, 33, 64), 3, 32, 11)
    starts = torch.tensor(start_list, dtype=torch.int64)
    num_tokens, isa = qkv.shape[0], kernels.best_isa()
    threads = torch.get_num_threads()
    try:
        for given in (qkv, qkv.bfloat16()):
            for num_threads in (1, 2):  # split over the threads; whole prompts a thread
                torch.set_num_threads(num_threads)
                wide, narrow = torch.empty(num_tokens, 3, 32), torch.empty(num_tokens, 3, 32, dtype=torch.bfloat16)
                kernels.packed_bidirectional_attention(given, starts, 3, 32**-0.5, isa, wide, True)
                kernels.packed_bidirectional_attention(given, starts, 3, 32**-0.5, isa, narrow, True)
                assert torch.equal(narrow, wide.bfloat16()), f"{given.dtype}, {num_threads} thread(s)"
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="out must be float32"):
        kernels.packed_bidirectional_attention(qkv, starts, 3, 32**-0.5, isa, narrow, False)


@pytest.mark.parametrize("head_dim", [32, 64])
def test_scores_out_of_the_plain_softmaxs_range_take_the_shifted_one(kernels, head_dim: int) -> None:
    """The AMX tiles take p = 2^s unshifted while every row's sum stays within [2^-60, 2^120] and
    its o finite, and run a tile again with each row's running maximum where it does not: a prompt
    whose queries each score their own key a few hundred above the rest (2^s overflows; the
    softmax is one-hot, each out its own v), one whose every score is the same, about -200 (2^s
    underflows to 0; the softmax is uniform, each out the mean of v), and one whose own scores are
    about 100 (2^s finite) over values of 1e30 (o = p v is not), against float64. Skipped without AMX."""
    if kernels.best_isa() < ISAS["amx"]:
        pytest.skip("this CPU has no AMX (or the kernel gave no leave to use it): the tiles' softmax does not run here")
    num_heads, scale = 2, head_dim**-0.5
    gen = torch.Generator().manual_seed(head_dim)
    peaked = torch.randn(70, 3, num_heads, head_dim, generator=gen)
    peaked[:, 0] = 40 * peaked[:, 1]  # q . k of its own key about 40 D, of another's about 40 sqrt(D)
    direction = torch.randn(num_heads, head_dim, generator=gen)
    uniform = torch.randn(50, 3, num_heads, head_dim, generator=gen)
    uniform[:, 0] = -200 / (scale * direction.square().sum(-1, keepdim=True)) * direction
    uniform[:, 1] = direction
    wide = torch.randn(30, 3, num_heads, head_dim, generator=gen)
    wide[:, 1] /= wide[:, 1].norm(dim=-1, keepdim=True)
    wide[:, 0] = 70 / scale * wide[:, 1]  # its own key's score 70 (about 100 log2 units), another's about 70 / sqrt(D)
    wide[:, 2] *= 1e30
    qkv = torch.cat([peaked, uniform, wide]).view(150, -1).bfloat16().float()
    starts = [0, 70, 120, 150]
    expected = _dense(qkv, starts, num_heads, scale)
    v = qkv.view(150, 3, num_heads, head_dim)[:, 2].double()
    assert torch.allclose(expected[:70], v[:70], atol=1e-6) and torch.allclose(expected[70:120], v[70:120].mean(0), atol=1e-6)
    assert torch.allclose(expected[120:], v[120:], rtol=1e-6)
    out = torch.empty(150, num_heads, head_dim)
    kernels.packed_bidirectional_attention(qkv, torch.tensor(starts), num_heads, scale, ISAS["amx"], out, True)
    torch.testing.assert_close(out[:120].double(), expected[:120], atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out[120:].double(), expected[120:], atol=0, rtol=1e-2)
