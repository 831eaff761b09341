"""GGUF's quantized blocks kept packed: QuantizedWeight's repacking gives back the `gguf` package's
own dequantization float for float, and the integer-dot kernels (activations quantized per 32 k)
match a float64 reference on odd shapes (M = 1, 3, 17, 70; N not a multiple of the 16-row panel)
on every path this CPU runs: scalar, AVX2 (forced on AVX-512 machines) and AVX-512 VNNI; the
5-bit types (Q5_0, Q5_1, Q5_K) and MXFP4 also from weights quantized as the files hold them, and
MXFP4's E8M0 scale bytes at their edges (subnormal, overflowing)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from bench.kquants import quantize_q5_k
from bench.random_blocks import random_blocks, scale_bytes
from engine.execution.kernels import ISAS
from engine.execution.weights.ggml_blocks import KERNEL_TYPES, block_size, e8m0_half
from engine.execution.weights.quantized_weight import QuantizedWeight
from tests.helpers import ISA_NAMES

T = GGMLQuantizationType


def quantized_rows(x: np.ndarray) -> np.ndarray:
    """x [M, K] as the kernels see it: each 32-k block scaled to int8 by max |x| / 127, rounded to
    nearest even (the same float32 operations), back in float64."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32).astype(np.float32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    inv = np.float32(127) / np.where(amax > 0, amax, np.float32(1))
    q = np.rint(blocks * np.where(amax > 0, inv, np.float32(0)))
    return (q.astype(np.float64) * (amax / np.float32(127)).astype(np.float64)).reshape(m, k)


@pytest.mark.parametrize("quant_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_dequantize_is_the_gguf_packages_dequantization(quant_type: T) -> None:
    rng = np.random.default_rng(int(quant_type))
    n, k = 37, 2 * 256  # 3 panels, the last with 5 rows; 2 super-blocks
    blocks = random_blocks(quant_type, n, k, rng)
    weight = QuantizedWeight.pack(blocks, quant_type, k)
    assert weight.data.dtype == torch.uint8 and weight.data.shape[0] == 3
    expected = dequantize(blocks, quant_type).reshape(n, k)
    assert np.array_equal(weight.dequantize().numpy(), expected)  # bit for bit, no tolerance
    # the file's bytes for the 48 rows of 3 panels, Q4_K's and Q5_K's 6-bit scales packed as 6 bits
    assert weight.num_bytes == blocks.nbytes * 48 // n


# What llama.cpp's quantizer writes where a matrix's rows are no multiple of 256 (Gemma-3-1B's
# 1152-wide hidden size: Q5_0 for Q4_K, Q5_1 for Q5_K), and Q5_K_M's own type, from float weights.
@pytest.mark.parametrize(("quant_type", "k"), [(T.Q5_0, 1152), (T.Q5_1, 1152), (T.Q5_K, 1280)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_five_bit_blocks_quantized_from_weights_run_as_the_gguf_package_reads_them(kernels, quant_type: T,
                                                                                  k: int) -> None:
    rng = np.random.default_rng(k)
    values = (rng.standard_normal((50, k)) * 0.05).astype(np.float32)
    blocks = quantize_q5_k(values) if quant_type == T.Q5_K else quantize(values, quant_type)
    weight = QuantizedWeight.pack(blocks, quant_type, k)
    expected = dequantize(blocks, quant_type).reshape(50, k)
    assert np.array_equal(weight.dequantize().numpy(), expected)
    assert np.abs(expected - values).max() < 0.1 * np.abs(values).max()  # the weights, 5 bits deep
    assert len(np.unique(weight.fields().codes)) == 32  # every code, the top bit's included, in use
    x = rng.standard_normal((2, k)).astype(np.float32)
    exact = quantized_rows(x) @ expected.T.astype(np.float64)
    for isa in range(kernels.best_isa() + 1):
        out = weight.linear(torch.from_numpy(x), kernels, isa).double().numpy()
        assert np.abs(out - exact).max() < 1e-4 * np.abs(exact).max(), ISA_NAMES[isa]


@pytest.mark.parametrize("quant_type", KERNEL_TYPES, ids=lambda t: t.name)
# K: 3 and 5 blocks of 32, or 1 and 2 super-blocks; N = 984: 62 panels, so tasks take several.
# N = 647 at one and two rows: 41 panels, tasks of 6, which the VNNI tile takes 4 or 2 at once
# (then 2 or 1), the last panel with 7 rows.
@pytest.mark.parametrize("shape", [(1, 1, 20), (3, 2, 50), (17, 1, 33), (70, 2, 984), (1, 2, 647), (2, 1, 647)],
                         ids=lambda s: "M{}-blocks{}-N{}".format(*s))
def test_quant_linear_matches_the_dequantized_matrix(kernels, quant_type: T, shape: tuple[int, int, int]) -> None:
    m, num_blocks, n = shape
    k = 256 * num_blocks if block_size(quant_type) == 256 else {1: 96, 2: 160}[num_blocks]
    rng = np.random.default_rng(m * 1000 + n)
    blocks = random_blocks(quant_type, n, k, rng)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    weight = QuantizedWeight.pack(blocks, quant_type, k, bias)
    w = weight.dequantize().double().numpy()
    x = rng.standard_normal((m, k)).astype(np.float32)
    exact = quantized_rows(x) @ w.T + bias.double().numpy()  # the only rounding the kernels add is x's
    floats = x.astype(np.float64) @ w.T + bias.double().numpy()
    magnitude = np.abs(quantized_rows(x)) @ np.abs(w.T)  # [M, N]: the sum of |terms| of each output
    for isa in range(kernels.best_isa() + 1):
        out = weight.linear(torch.from_numpy(x), kernels, isa)
        assert out.shape == (m, n) and out.dtype == torch.float32
        err = np.abs(out.double().numpy() - exact)
        assert (err <= 1e-5 * magnitude + 1e-6).all(), f"{ISA_NAMES[isa]}: max error {err.max()}"
        # per-block int8 activations: a small share of each output's size
        assert np.abs(out.double().numpy() - floats).max() < 0.02 * np.abs(floats).max(), ISA_NAMES[isa]


# The code byte that gives each type's largest operand where the kernels multiply: Q8_0's -128
# (|q| = 128), MXFP4's nibble 7 (+6, 12 doubled, 24 once offset); every other type's 0xFF (all
# bits set: Q4's 15, Q5's 31, Q6_K's 63; the K-quants' 6-bit scales and minimums 63, Q6_K's int8
# scales -1).
_LARGEST_CODE_BYTE = {T.Q8_0: 0x80, T.MXFP4: 0x77}


@pytest.mark.parametrize("quant_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_quant_linear_holds_the_largest_codes_against_the_largest_activations(kernels, quant_type: T) -> None:
    """Every code at its largest against activations all at +-127 (a constant row): each integer
    partial sum at its bound. The AVX2 tiles add vpmaddubsw's int16 results before widening them
    (8 for 4-bit codes, 4 for 5-bit and MXFP4, 2 for Q6_K): a group one step larger for the 5-bit
    types, MXFP4 or Q6_K wraps an int16 lane, far past this bound (4-bit and Q8_0 groups cannot
    grow: a block has 8 results). 7 rows: the AVX2 tiles of 4 and 3 rows (Q6_K: 2 and 1)."""
    n, k = 40, 512
    blocks = random_blocks(quant_type, n, k, np.random.default_rng(int(quant_type)))
    blocks = blocks.reshape(n, k // block_size(quant_type), -1)
    blocks[..., ~scale_bytes(quant_type)] = _LARGEST_CODE_BYTE.get(quant_type, 0xFF)
    blocks = blocks.reshape(n, -1)
    weight = QuantizedWeight.pack(blocks, quant_type, k)
    w = weight.dequantize().double().numpy()
    x = np.ones((7, k), dtype=np.float32)
    x[1::2] = -1.0
    x[2] = np.where(np.arange(k) % 64 < 32, 0.5, -2.0)  # blocks of each sign
    exact = quantized_rows(x) @ w.T
    magnitude = np.abs(quantized_rows(x)) @ np.abs(w.T)
    for isa in range(kernels.best_isa() + 1):
        out = weight.linear(torch.from_numpy(x), kernels, isa).double().numpy()
        err = np.abs(out - exact)
        assert (err <= 1e-5 * magnitude + 1e-6).all(), f"{ISA_NAMES[isa]}: max error {err.max()}"


def test_quant_linear_paths_agree_with_each_other(kernels) -> None:
    """The vector paths' integer sums are the scalar reference's: their outputs differ only by
    float rounding of the per-block sums."""
    rng = np.random.default_rng(7)
    for quant_type in KERNEL_TYPES:
        blocks = random_blocks(quant_type, 40, 512, rng)
        weight = QuantizedWeight.pack(blocks, quant_type, 512)
        x = torch.from_numpy(rng.standard_normal((5, 512)).astype(np.float32))
        scalar = weight.linear(x, kernels, ISAS["scalar"])
        for isa in range(ISAS["avx2"], kernels.best_isa() + 1):
            torch.testing.assert_close(weight.linear(x, kernels, isa), scalar, rtol=1e-5, atol=1e-5)


AMX_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4, T.Q4_K, T.Q5_K)


def skip_without_amx_int8(kernels, quant_type: T) -> None:
    if not kernels.can_run_quant_amx(int(quant_type)):
        pytest.skip("this CPU has no AMX-INT8 tiles (or the process may not use them): the AMX path is not run here")


@pytest.mark.parametrize("quant_type", AMX_TYPES, ids=lambda t: t.name)
# M: one tile, a ragged second tile, two tasks' rows with a ragged end; K: 1, 3 (odd: the tile's
# last block on its own) and 64 blocks (the K-quants: 1, 2 and 8 super-blocks); N: a ragged last
# panel.
@pytest.mark.parametrize("shape", [(16, 32, 16), (17, 96, 37), (300, 2048, 40), (600, 160, 984)],
                         ids=lambda s: "M{}-K{}-N{}".format(*s))
def test_amx_int8_tiles_give_the_vnni_tiles_outputs_bit_for_bit(kernels, quant_type: T,
                                                               shape: tuple[int, int, int]) -> None:
    """The AMX tiles' int32 dots are the VNNI tiles' integer sums, scaled by the same float
    operations in the same order: equal outputs, through the AMX tiles alone and through the
    product that routes many rows to them."""
    skip_without_amx_int8(kernels, quant_type)
    m, k, n = shape
    if block_size(quant_type) == 256:
        k = {32: 256, 96: 512, 160: 256, 2048: 2048}[k]
    rng = np.random.default_rng(m + k + n + int(quant_type))
    blocks = random_blocks(quant_type, n, k, rng)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    weight = QuantizedWeight.pack(blocks, quant_type, k, bias)
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    vnni = weight.linear(x, kernels, ISAS["avx512"])
    tiles = kernels.quant_tiles_amx(x, weight.data, int(quant_type))[:, :n] + bias
    assert torch.equal(tiles, vnni)
    assert torch.equal(weight.linear(x, kernels, ISAS["amx"]), vnni)
    exact = quantized_rows(x.numpy()) @ weight.dequantize().double().numpy().T + bias.double().numpy()
    assert np.abs(tiles.double().numpy() - exact).max() < 1e-4 * np.abs(exact).max()


def test_amx_int8_tiles_fail_for_a_mutated_weight(kernels) -> None:
    """The check above can fail: one code of one block changed changes the tiles' outputs."""
    skip_without_amx_int8(kernels, T.Q4_0)
    rng = np.random.default_rng(3)
    blocks = random_blocks(T.Q4_0, 16, 96, rng)
    x = torch.from_numpy(rng.standard_normal((16, 96)).astype(np.float32))
    clean = kernels.quant_tiles_amx(x, QuantizedWeight.pack(blocks, T.Q4_0, 96).data, int(T.Q4_0))
    blocks.reshape(16, -1)[5, 2 * 18 + 4] ^= 0x01  # row 5, third block, code 2 (k = 66)
    mutated = kernels.quant_tiles_amx(x, QuantizedWeight.pack(blocks, T.Q4_0, 96).data, int(T.Q4_0))
    changed = (mutated != clean).any(dim=0)
    assert changed[5] and int(changed.sum()) == 1


def test_bad_weights_are_refused(kernels) -> None:
    rng = np.random.default_rng(3)
    blocks = random_blocks(T.Q4_0, 20, 64, rng)
    with pytest.raises(ValueError, match="in_features: 48 is not a multiple"):
        QuantizedWeight.pack(blocks[:, :27], T.Q4_0, 48)
    with pytest.raises(ValueError, match=r"blocks: expected uint8 \[N, 36\]"):
        QuantizedWeight.pack(blocks[:, :18], T.Q4_0, 64)
    with pytest.raises(ValueError, match="no kernel for Q3_K"):
        QuantizedWeight.pack(blocks, T.Q3_K, 64)
    weight = QuantizedWeight.pack(blocks, T.Q4_0, 64)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="is not type 2 panels of K = 96"):
        kernels.quant_linear(torch.randn(2, 96), *weight.as_args(), 0)
    with pytest.raises(RuntimeError, match="no kernel for ggml type 11"):
        kernels.quant_linear(x, weight.data, int(T.Q3_K), None, 20, 0)
    with pytest.raises(RuntimeError, match="panels for 40 outputs"):
        kernels.quant_linear(x, weight.data, int(T.Q4_0), None, 40, 0)
    with pytest.raises(RuntimeError, match="bias must be"):
        kernels.quant_linear(x, weight.data, int(T.Q4_0), torch.zeros(3), 20, 0)


@pytest.mark.parametrize("quant_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_quant_rows_are_the_dequantized_rows(kernels, quant_type: T) -> None:
    """An embedding's lookup from the panels: each row's floats as the gguf package dequantizes them."""
    rng = np.random.default_rng(11)
    n, k = 45, 512
    weight = QuantizedWeight.pack(random_blocks(quant_type, n, k, rng), quant_type, k)
    ids = torch.tensor([44, 0, 17, 17, 31, 16, 15])
    rows = kernels.quant_rows(weight.data, int(quant_type), ids, n, k)
    assert torch.equal(rows, weight.dequantize()[ids])
    with pytest.raises(RuntimeError, match="id 45 outside 45 rows"):
        kernels.quant_rows(weight.data, int(quant_type), torch.tensor([45]), n, k)


@pytest.mark.parametrize("m", [1, 3, 17])
def test_a_teams_share_computes_what_one_call_does(kernels, m: int) -> None:
    """quant_gemm with a team (DecodeModel's way: home ranges, each member quantizing x itself),
    through the benchmark's chain, gives quant_linear's floats exactly."""
    rng = np.random.default_rng(m)
    weights = [QuantizedWeight.pack(random_blocks(t, 200, 256, rng), t, 256) for t in (T.Q4_K, T.Q4_1, T.Q5_0, T.Q5_K)]
    x = torch.randn(m, 256)
    for isa in range(kernels.best_isa() + 1):
        for w in weights:  # a chain of one: the chain writes each product over the last one's
            out = torch.full((m * 200,), float("nan"))
            kernels.quant_chain_seconds(x, [(w.data, int(w.quant_type), w.out_features, w.in_features)], 2, isa, out)
            assert torch.equal(out.view(m, 200), w.linear(x, kernels, isa)), (w.quant_type.name, ISA_NAMES[isa])


@pytest.mark.parametrize("quant_type", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_one_and_two_row_products_match_the_dequantized_matrix_on_any_number_of_threads(
        kernels, quant_type: T, num_threads: int) -> None:
    """At one and two rows the VNNI tile takes 4 panels at once (Q4_K, Q5_K at one row) or 2, each
    from its own quarter (half) of a task's panels. 41 panels over 1, 2 or 3 threads make tasks of
    11, 6 and 4 panels: streams of 2 panels and of 1, leftovers run alone, whatever the machine's
    core count. quant_linear's fork and the team's chain (a decode step's way) both match float64."""
    k = 512 if block_size(quant_type) == 256 else 160
    rng = np.random.default_rng(num_threads * 100 + int(quant_type))
    weight = QuantizedWeight.pack(random_blocks(quant_type, 647, k, rng), quant_type, k)
    w = weight.dequantize().double().numpy()
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        for m in (1, 2):
            x = rng.standard_normal((m, k)).astype(np.float32)
            exact = quantized_rows(x) @ w.T
            magnitude = np.abs(quantized_rows(x)) @ np.abs(w.T)
            for isa in range(kernels.best_isa() + 1):
                chained = torch.full((m * 647,), float("nan"))
                kernels.quant_chain_seconds(torch.from_numpy(x), [(weight.data, int(quant_type), 647, k)], 2, isa,
                                            chained)
                for path, out in (("linear", weight.linear(torch.from_numpy(x), kernels, isa)),
                                  ("chain", chained.view(m, 647))):
                    err = np.abs(out.double().numpy() - exact)
                    assert (err <= 1e-5 * magnitude + 1e-6).all(), f"{ISA_NAMES[isa]} {path} M={m}: {err.max()}"
    finally:
        torch.set_num_threads(previous)


def mxfp4_blocks(n: int, k: int, rng: np.random.Generator, exponents: np.ndarray | None = None) -> np.ndarray:
    """[n, k / 32 * 17] uint8 MXFP4 rows: random code bytes, the scale bytes `exponents` ([n, k / 32])
    or random_blocks' sane range."""
    blocks = random_blocks(T.MXFP4, n, k, rng).reshape(n, k // 32, 17)
    if exponents is not None:
        blocks[..., 0] = exponents
    return blocks.reshape(n, -1)


def test_mxfp4_dequantize_is_the_gguf_packages_at_every_scale_byte() -> None:
    """All 256 E8M0 bytes (e = 0 and 1 subnormal, e = 255 overflowing to inf for the larger codes,
    as the gguf package computes them) with every code: the panels give back its floats bit for bit."""
    rng = np.random.default_rng(39)
    n, k = 37, 7 * 32  # 3 panels, the last with 5 rows
    exponents = np.arange(n * k // 32).reshape(n, k // 32) % 256
    blocks = mxfp4_blocks(n, k, rng, exponents.astype(np.uint8))
    weight = QuantizedWeight.pack(blocks, T.MXFP4, k)
    with np.errstate(over="ignore"):
        expected = dequantize(blocks, T.MXFP4).reshape(n, k)
    assert np.isinf(expected).any() and (np.abs(expected[expected != 0]) < 1e-38).any()  # both edges reached
    assert np.array_equal(weight.dequantize().numpy(), expected)
    assert weight.data.shape == (3, 7, 16 + 256) and weight.num_bytes == blocks.nbytes * 48 // n  # 4.25 bits a weight
    # e = 0 is 2^-128 (subnormal), e = 255 is 2^127: the table's 1 and 2 at each end (2 x 2^127: inf)
    one = np.zeros((1, 17), dtype=np.uint8)
    one[0, 1], one[0, 2] = 0x21, 0x01  # k = 0: code 1 (value 1), k = 16: code 2 (value 2), k = 1: code 1
    for e, scale in ((0, 2.0 ** -128), (1, 2.0 ** -127), (2, 2.0 ** -126), (127, 0.5), (255, 2.0 ** 127)):
        one[0, 0] = e
        got = QuantizedWeight.pack(one, T.MXFP4, 32).dequantize().numpy()[0]
        with np.errstate(over="ignore"):  # 2 x 2^127
            assert got[0] == np.float32(scale) and got[16] == np.float32(2 * scale) and got[1] == np.float32(scale)


def test_mxfp4_quantized_from_weights_runs_as_the_gguf_package_reads_it(kernels) -> None:
    """gpt-oss-like expert rows (K = 2880) quantized by the gguf package: every path's products
    within the other types' bound of the dequantized matrix."""
    rng = np.random.default_rng(2880)
    n, k = 50, 2880
    values = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    blocks = quantize(values, T.MXFP4)
    weight = QuantizedWeight.pack(blocks, T.MXFP4, k)
    expected = dequantize(blocks, T.MXFP4).reshape(n, k)
    assert np.array_equal(weight.dequantize().numpy(), expected)
    assert np.abs(expected - values).max() < 0.3 * np.abs(values).max()  # E2M1: 2 bits of mantissa
    assert len(np.unique(weight.fields().codes)) == 15  # all but 8: -0, never chosen over 0
    x = rng.standard_normal((3, k)).astype(np.float32)
    exact = quantized_rows(x) @ expected.T.astype(np.float64)
    magnitude = np.abs(quantized_rows(x)) @ np.abs(expected.T.astype(np.float64))
    for isa in range(kernels.best_isa() + 1):
        out = weight.linear(torch.from_numpy(x), kernels, isa).double().numpy()
        assert (np.abs(out - exact) <= 1e-5 * magnitude + 1e-6).all(), ISA_NAMES[isa]


def test_mxfp4_vector_tiles_scale_by_every_e8m0_byte_as_the_scalar_reference(kernels) -> None:
    """256 rows, row e scaled by E8M0 byte e (subnormal 2^-128 at e = 0, 2^127 at e = 255): one
    block's products are one rounding of the same integer sum times the same scale on every path."""
    rng = np.random.default_rng(255)
    blocks = mxfp4_blocks(256, 32, rng, np.arange(256, dtype=np.uint8)[:, None])
    weight = QuantizedWeight.pack(blocks, T.MXFP4, 32)
    x = torch.from_numpy(rng.standard_normal((3, 32)).astype(np.float32))
    scalar = weight.linear(x, kernels, ISAS["scalar"])
    assert torch.isinf(scalar).any() and ((scalar != 0) & (scalar.abs() < 1e-37)).any()
    for isa in range(ISAS["avx2"], kernels.best_isa() + 1):
        assert torch.equal(weight.linear(x, kernels, isa), scalar), ISA_NAMES[isa]


# MXFP4 read wrongly, [N, K] float64: the nibbles' halves swapped (k and k + 16 exchanged), or the
# codes taken as plain 4-bit integers (Q4_0's q - 8) instead of E2M1's sign and magnitude.
def _nibbles_swapped(blocks: np.ndarray) -> np.ndarray:
    b = blocks.reshape(blocks.shape[0], -1, 17).copy()
    b[..., 1:] = (b[..., 1:] >> 4) | (b[..., 1:] << 4)
    return dequantize(b.reshape(blocks.shape), T.MXFP4).reshape(blocks.shape[0], -1).astype(np.float64)


def _linear_table(blocks: np.ndarray) -> np.ndarray:
    b = blocks.reshape(blocks.shape[0], -1, 17)
    codes = np.concatenate([b[..., 1:] & 0x0F, b[..., 1:] >> 4], axis=-1).astype(np.float64) - 8
    return (e8m0_half(b[..., 0]).astype(np.float64)[..., None] * codes).reshape(blocks.shape[0], -1)


@pytest.mark.parametrize("mutation", [_nibbles_swapped, _linear_table], ids=lambda f: f.__name__.strip("_"))
def test_mxfp4_checks_fail_for_a_mutated_reading(kernels, mutation) -> None:
    """The bound the MXFP4 products are held to is tight enough to catch a wrong nibble order or a
    wrong value table: each path's products meet it against the right matrix, not a mutated one."""
    rng = np.random.default_rng(4)
    n, k = 33, 160
    blocks = mxfp4_blocks(n, k, rng)
    weight = QuantizedWeight.pack(blocks, T.MXFP4, k)
    right, wrong = weight.dequantize().double().numpy(), mutation(blocks)
    x = rng.standard_normal((2, k)).astype(np.float32)
    magnitude = np.abs(quantized_rows(x)) @ np.abs(right.T)
    for isa in range(kernels.best_isa() + 1):
        out = weight.linear(torch.from_numpy(x), kernels, isa).double().numpy()
        assert (np.abs(out - quantized_rows(x) @ right.T) <= 1e-5 * magnitude + 1e-6).all(), ISA_NAMES[isa]
        assert not (np.abs(out - quantized_rows(x) @ wrong.T) <= 1e-5 * magnitude + 1e-6).all(), ISA_NAMES[isa]


def test_packed_linear_knows_mxfp4_panels_by_their_record_size(kernels) -> None:
    """The fused layers' and decode step's entry (packed_linear, uint8 panels without a type) takes
    MXFP4's 272-byte records for MXFP4: quant_linear's floats, no other type's."""
    rng = np.random.default_rng(272)
    weight = QuantizedWeight.pack(mxfp4_blocks(40, 2880, rng), T.MXFP4, 2880,
                                  torch.from_numpy(rng.standard_normal(40).astype(np.float32)))
    x = torch.from_numpy(rng.standard_normal((3, 2880)).astype(np.float32))
    assert weight.data.shape[-1] == 272
    for isa in range(kernels.best_isa() + 1):
        out = kernels.packed_linear(x, weight.data, None, weight.bias, weight.out_features, isa)
        assert torch.equal(out, weight.linear(x, kernels, isa)), ISA_NAMES[isa]


@pytest.mark.parametrize("quant_type", [T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_k_quant_tiles_unpack_alike_with_gfni_and_without(kernels, quant_type: T) -> None:
    """A VNNI CPU without GFNI (Cascade Lake) moves a K-quant record's top bits by shifts and masks:
    the same integer sums as the GFNI transform, so the same floats, at every tile shape the
    engine runs (1-4 rows; 4 or 2 panels at once at one row, 2 at two), both as the dequantized
    matrix gives them. A GFNI CPU runs only the GFNI tile in the engine: this is its one check."""
    if kernels.best_isa() < ISAS["avx512"] or not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        pytest.skip("this CPU has no AVX-512: the VNNI tiles do not run here")
    rng = np.random.default_rng(int(quant_type))
    n, k = 64, 512  # 4 panels of 2 super-blocks
    blocks = random_blocks(quant_type, n, k, rng)
    weight = QuantizedWeight.pack(blocks, quant_type, k)
    data, type_id = weight.as_args()[:2]
    w = weight.dequantize().double().numpy()
    try:
        kernels.quant_tile_unpack(torch.zeros(1, k), data, type_id, 1, False)
    except RuntimeError as error:
        pytest.skip(f"no VNNI tile here: {error}")
    for rows in (1, 2, 3, 4):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        exact = (quantized_rows(x) @ w.T).reshape(rows, 4, 16).transpose(1, 0, 2)  # [panels, rows, 16]
        magnitude = (np.abs(quantized_rows(x)) @ np.abs(w.T)).reshape(rows, 4, 16).transpose(1, 0, 2)
        group = 4 if rows == 1 and quant_type != T.Q6_K else 2 if rows <= 2 else 1  # quant_tile_panels
        for num_panels in sorted({1, group}):
            without = kernels.quant_tile_unpack(torch.from_numpy(x), data, type_id, num_panels, False)
            err = np.abs(without.double().numpy() - exact[:num_panels])
            assert (err <= 1e-5 * magnitude[:num_panels] + 1e-6).all(), f"rows {rows} x {num_panels}: {err.max()}"
            try:
                with_gfni = kernels.quant_tile_unpack(torch.from_numpy(x), data, type_id, num_panels, True)
            except RuntimeError:  # a VNNI CPU without GFNI: the path above is its engine's
                continue
            assert torch.equal(with_gfni, without), f"rows {rows} x {num_panels}"
