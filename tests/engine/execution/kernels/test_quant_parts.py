"""A fused projection whose parts are GGUF blocks of different types (QuantizedParts: a Q4_K_M
file's q, k in Q4_K and v in Q6_K), served in the file's own types: its floats are each part's
as the gguf package dequantizes them, and every path that multiplies it (packed_linear, a team's
share, the fused layer) gives each part's own product in its slice of the output."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from bench.random_blocks import random_blocks
from engine.execution.weights.gguf_file import GGUFTensor
from engine.execution.weights.gguf_loader import _quantized
from engine.execution.weights.quantized_parts import HEADER_BYTES, QuantizedParts
from engine.execution.weights.quantized_weight import QuantizedWeight
from tests.helpers import ISA_NAMES

T = GGMLQuantizationType
K = 512  # two super-blocks
# (type, rows) of each part: Q4_K_M's q + k | v; a 5-bit and an 8-bit one; three types, the last part's panel partial
CASES = [((T.Q4_K, 96), (T.Q6_K, 32)), ((T.Q5_0, 48), (T.Q8_0, 16)), ((T.Q4_K, 32), (T.Q5_K, 16), (T.Q6_K, 21))]


def _parts(case, rng: np.random.Generator) -> tuple[list[np.ndarray], QuantizedParts, torch.Tensor]:
    blocks = [random_blocks(t, n, K, rng) for t, n in case]
    bias = torch.from_numpy(rng.standard_normal(sum(n for _, n in case)).astype(np.float32))
    parts = QuantizedParts.of([QuantizedWeight.pack(b, t, K) for b, (t, _) in zip(blocks, case, strict=True)], bias)
    return blocks, parts, bias


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{t.name}x{n}" for t, n in c))
def test_dequantize_is_each_parts_gguf_dequantization(case) -> None:
    rng = np.random.default_rng(len(case))
    blocks, parts, _ = _parts(case, rng)
    expected = np.concatenate([dequantize(b, t).reshape(n, K) for b, (t, n) in zip(blocks, case, strict=True)])
    assert np.array_equal(parts.dequantize().numpy(), expected)  # bit for bit
    assert parts.part_types == tuple(t for t, _ in case) and parts.out_features == expected.shape[0]
    # the bytes are the parts' panels and the header, nothing more
    singles = [QuantizedWeight.pack(b, t, K) for b, (t, _) in zip(blocks, case, strict=True)]
    assert parts.data.numel() == HEADER_BYTES + sum(w.data.numel() for w in singles)


def test_parts_that_cannot_be_panels_are_refused() -> None:
    rng = np.random.default_rng(1)
    q = QuantizedWeight.pack(random_blocks(T.Q4_K, 40, K, rng), T.Q4_K, K)
    v = QuantizedWeight.pack(random_blocks(T.Q6_K, 16, K, rng), T.Q6_K, K)
    with pytest.raises(ValueError, match=r"rows \[40, 16\]"):
        QuantizedParts.of([q, v])
    assert QuantizedParts.fits([32, 16, 5]) and not QuantizedParts.fits([16] * 4)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{t.name}x{n}" for t, n in c))
@pytest.mark.parametrize("m", [1, 3, 17])
def test_a_product_is_each_parts_product_in_its_slice(kernels, case, m: int) -> None:
    """Each panel runs its own part's tiles: the parts' output is each part's own quant_linear,
    float for float, on every path."""
    rng = np.random.default_rng(m)
    _, parts, bias = _parts(case, rng)
    x = torch.from_numpy(rng.standard_normal((m, K)).astype(np.float32))
    slices = bias.split([n for _, n in case])
    for isa in range(kernels.best_isa() + 1):
        expected = torch.cat([kernels.quant_linear(x, w.data, int(w.quant_type), b.contiguous(), w.out_features, isa)
                              for w, b in zip(parts.parts, slices, strict=True)], dim=1)
        assert torch.equal(parts.linear(x, kernels, isa), expected), ISA_NAMES[isa]
        # a team's share (DecodeModel's way), through the benchmark's chain
        out = torch.full((m * parts.out_features,), float("nan"))
        kernels.packed_chain_seconds(x, [((parts.data, None, parts.bias, parts.out_features), K)], 2, isa, out)
        assert torch.equal(out.view(m, -1), expected), ISA_NAMES[isa]


def test_bad_headers_are_refused(kernels) -> None:
    rng = np.random.default_rng(2)
    _, parts, _ = _parts(CASES[0], rng)
    x = torch.randn(1, K)
    with pytest.raises(RuntimeError, match="is not type 12 panels of K = 256"):
        kernels.packed_linear(torch.randn(1, 256), parts.data, None, None, 128, 0)
    with pytest.raises(RuntimeError, match="8 panels for 200 outputs"):
        kernels.packed_linear(x, parts.data, None, None, 200, 0)
    broken = parts.data.clone()
    broken[:4] = torch.tensor([9, 0, 0, 0], dtype=torch.uint8)  # nine parts
    with pytest.raises(RuntimeError, match="9 parts"):
        kernels.packed_linear(x, broken, None, None, 128, 0)
    with pytest.raises(RuntimeError, match="bytes in a tensor of"):
        kernels.packed_linear(x, parts.data[:-1], None, None, 128, 0)


def _tensor(name: str, t: T, rows: int, rng: np.random.Generator) -> GGUFTensor:
    return GGUFTensor(name, t, (rows, K), random_blocks(t, rows, K, rng))


def test_the_loader_keeps_each_run_of_one_type_and_requantizes_only_what_cannot_be_panels(
        caplog: pytest.LogCaptureFixture) -> None:
    rng = np.random.default_rng(5)
    q, k, v = _tensor("q", T.Q4_K, 64, rng), _tensor("k", T.Q4_K, 32, rng), _tensor("v", T.Q6_K, 32, rng)
    with caplog.at_level(logging.INFO, logger="engine.execution.weights.gguf_loader"):
        mixed = _quantized("layers.0.qkv_proj", [q, k, v], K, None)
    assert isinstance(mixed, QuantizedParts) and mixed.part_types == (T.Q4_K, T.Q6_K)
    assert mixed.part_rows == (96, 32) and "requantized" not in caplog.text
    expected = np.concatenate([dequantize(t.data, t.quant_type).reshape(t.shape) for t in (q, k, v)])
    assert np.array_equal(mixed.dequantize().numpy(), expected)
    # q of 40 rows: the Q4_K run is 40 + 10 rows, no whole panels; the whole goes to Q8_0, saying why
    odd = [_tensor("q", T.Q4_K, 40, rng), _tensor("k", T.Q4_K, 10, rng), _tensor("v", T.Q6_K, 8, rng)]
    with caplog.at_level(logging.INFO, logger="engine.execution.weights.gguf_loader"):
        requantized = _quantized("layers.1.qkv_proj", odd, K, None)
    assert isinstance(requantized, QuantizedWeight) and requantized.quant_type == T.Q8_0
    assert "layers.1.qkv_proj" in caplog.text and "[50, 8] rows" in caplog.text
