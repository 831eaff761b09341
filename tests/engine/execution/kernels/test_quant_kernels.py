"""GGUF's quantized blocks kept packed: QuantizedWeight's repacking gives back the `gguf` package's
own dequantization float for float, and the integer-dot kernels (activations quantized per 32 k)
match a float64 reference on odd shapes (M = 1, 3, 17, 70; N not a multiple of the 16-row panel)
on every path this CPU runs: scalar, AVX2 (forced on AVX-512 machines) and AVX-512 VNNI; the
5-bit types (Q5_0, Q5_1, Q5_K) also from weights quantized as llama.cpp's files hold them."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from bench.kquants import quantize_q5_k
from bench.random_blocks import random_blocks
from engine.execution.kernels import ISAS
from engine.execution.weights.ggml_blocks import KERNEL_TYPES, block_size
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
    # the same bytes as the file's, but Q4_K's and Q5_K's 6-bit scales, which take a byte each
    file_bytes = blocks.nbytes * 48 // n
    wider = {T.Q4_K: (148, 144), T.Q5_K: (180, 176)}.get(quant_type, (1, 1))
    assert weight.num_bytes == file_bytes * wider[0] // wider[1]


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
@pytest.mark.parametrize("shape", [(1, 1, 20), (3, 2, 50), (17, 1, 33), (70, 2, 984)],
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
