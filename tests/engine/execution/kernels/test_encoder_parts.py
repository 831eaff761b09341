"""The encoder's fused epilogues against torch: packed_linear_gelu (bias + exact or tanh GELU on
each output tile) and packed_linear_add_norm_ (bias + residual add + LayerNorm, in place), on
odd shapes (rows that leave partial tiles, N not a multiple of 16) and every SIMD path this CPU
runs, on float32 and bfloat16 panels."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.execution.kernels import ISAS
from engine.execution.weights.packed_weight import PackedWeight
from tests.helpers import ISA_NAMES

SHAPES = [(1, 37, 20), (17, 64, 50), (70, 96, 384)]


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "M{}-K{}-N{}".format(*s))
def test_packed_linear_gelu_equals_torch(kernels, approximate: str, shape: tuple[int, int, int]) -> None:
    m, k, n = shape
    gen = torch.Generator().manual_seed(m + k + n)
    weight, bias, x = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen), torch.randn(m, k, generator=gen)
    packed = PackedWeight.pack(weight, bias, torch.float32)
    expected = F.gelu((x.double() @ weight.double().T + bias.double()), approximate=approximate)
    for isa in range(kernels.best_isa() + 1):
        out = kernels.packed_linear_gelu(x, packed.data, packed.bias, n, isa, approximate == "tanh")
        assert out.shape == (m, n)
        err = (out.double() - expected).abs().max().item()
        assert err < 2e-5 * k**0.5, f"{ISA_NAMES[isa]}: max error {err}"


def test_gelu_holds_over_the_whole_range_and_the_negative_tail(kernels) -> None:
    """An identity weight puts x itself through the GELU: within 1e-6 of torch's exact GELU from
    -10 to 10 (the negative tail, where 1 + erf is tiny, included)."""
    x = torch.linspace(-10, 10, 4000).view(-1, 16)  # [250, 16]
    packed = PackedWeight.pack(torch.eye(16), None, torch.float32)
    for isa in range(kernels.best_isa() + 1):
        for approximate in ("none", "tanh"):
            out = kernels.packed_linear_gelu(x, packed.data, None, 16, isa, approximate == "tanh")
            torch.testing.assert_close(out, F.gelu(x, approximate=approximate), atol=1e-6, rtol=1e-5,
                                       msg=f"{ISA_NAMES[isa]} {approximate}")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "M{}-K{}-N{}".format(*s))
def test_packed_linear_add_norm_writes_the_normed_sum_over_the_residual(kernels, shape: tuple[int, int, int]) -> None:
    m, k, n = shape
    gen = torch.Generator().manual_seed(3 * m + k)
    weight, bias, x = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen), torch.randn(m, k, generator=gen)
    residual = torch.randn(m, n, generator=gen) * 3 + 1
    norm_weight, norm_bias = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    packed = PackedWeight.pack(weight, bias, torch.float32)
    summed = residual.double() + x.double() @ weight.double().T + bias.double()
    expected = F.layer_norm(summed, (n,), norm_weight.double(), norm_bias.double(), 1e-12)
    for isa in range(kernels.best_isa() + 1):
        out = residual.clone()
        assert kernels.packed_linear_add_norm_(x, packed.data, packed.bias, n, isa, out, norm_weight, norm_bias,
                                               1e-12) is None
        err = (out.double() - expected).abs().max().item()
        assert err < 1e-5, f"{ISA_NAMES[isa]}: max error {err}"
    with pytest.raises(RuntimeError, match="residual must be float32"):
        kernels.packed_linear_add_norm_(x, packed.data, packed.bias, n, 0, residual[:, :-1], norm_weight, norm_bias, 1e-12)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "M{}-K{}-N{}".format(*s))
def test_both_epilogues_take_bfloat16_panels(kernels, shape: tuple[int, int, int]) -> None:
    """A bfloat16 encoder's panels: the same epilogues, the products over the bfloat16 weights
    (and, on the vdpbf16ps / AMX paths, x rounded to bfloat16 as those paths read it)."""
    m, k, n = shape
    gen = torch.Generator().manual_seed(5 * m + n)
    weight, bias, x = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen), torch.randn(m, k, generator=gen)
    residual = torch.randn(m, n, generator=gen)
    norm_weight, norm_bias = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    packed = PackedWeight.pack(weight, bias, torch.bfloat16)
    w = weight.bfloat16().double()
    for isa in range(kernels.best_isa() + 1):
        xr = (x.bfloat16() if isa >= ISAS["avx512_bf16"] else x).double()
        product = xr @ w.T + bias.double()
        out = kernels.packed_linear_gelu(x, packed.data, packed.bias, n, isa, False)
        err = (out.double() - F.gelu(product)).abs().max().item()
        assert err < 2e-5 * k**0.5, f"{ISA_NAMES[isa]} gelu: max error {err}"
        normed = residual.clone()
        kernels.packed_linear_add_norm_(x, packed.data, packed.bias, n, isa, normed, norm_weight, norm_bias, 1e-12)
        expected = F.layer_norm(residual.double() + product, (n,), norm_weight.double(), norm_bias.double(), 1e-12)
        err = (normed.double() - expected).abs().max().item()
        assert err < 1e-4, f"{ISA_NAMES[isa]} add_norm: max error {err}"
    # the float32 weights' product is not what it computed: the panels' bfloat16 values are
    exact = F.gelu(x.double() @ weight.double().T + bias.double())
    assert (kernels.packed_linear_gelu(x, packed.data, packed.bias, n, 0, False).double() - exact).abs().max() > 1e-3


@pytest.mark.parametrize("shape", [(1, 37, 32), (33, 64, 64), (70, 96, 384), (17, 64, 50)],
                         ids=lambda s: "M{}-K{}-N{}".format(*s))
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bfloat16_gelu_output_is_the_float_output_rounded(kernels, approximate: str,
                                                          shape: tuple[int, int, int]) -> None:
    """bf16_out (on AMX, from the tiles' epilogue where N is a multiple of 32; elsewhere rounded
    after) holds the float32 output's bits rounded to nearest-even: what the down product rounds
    its input to, so taking it is no change to the encoder's numbers."""
    m, k, n = shape
    gen = torch.Generator().manual_seed(7 * m + n)
    weight, bias, x = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen), torch.randn(m, k, generator=gen)
    packed = PackedWeight.pack(weight, bias, torch.bfloat16)
    for isa in range(kernels.best_isa() + 1):
        for b in (packed.bias, None):
            wide = kernels.packed_linear_gelu(x, packed.data, b, n, isa, approximate == "tanh")
            narrow = kernels.packed_linear_gelu(x, packed.data, b, n, isa, approximate == "tanh", True)
            assert narrow.dtype == torch.bfloat16 and narrow.shape == (m, n)
            assert torch.equal(narrow, wide.bfloat16()), f"{ISA_NAMES[isa]} bias={b is not None}"


@pytest.mark.parametrize("shape", [(70, 96, 384), (5, 64, 40), (9, 40, 24)], ids=lambda s: "M{}-K{}-N{}".format(*s))
def test_add_norm_takes_bfloat16_rows_as_their_float_values(kernels, shape: tuple[int, int, int]) -> None:
    """x in bfloat16 (the GELU's bf16_out; straight to the tiles on AMX where K is a multiple of
    32) gives the bits its float32 widening gives."""
    m, k, n = shape
    gen = torch.Generator().manual_seed(11 * m + k)
    weight, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    x = torch.randn(m, k, generator=gen).bfloat16()
    residual = torch.randn(m, n, generator=gen)
    norm_weight, norm_bias = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        packed = PackedWeight.pack(weight, bias, dtype)
        for isa in range(kernels.best_isa() + 1):
            from_bf16, from_float = residual.clone(), residual.clone()
            kernels.packed_linear_add_norm_(x, packed.data, packed.bias, n, isa, from_bf16, norm_weight, norm_bias, 1e-12)
            kernels.packed_linear_add_norm_(x.float(), packed.data, packed.bias, n, isa, from_float, norm_weight,
                                            norm_bias, 1e-12)
            assert torch.equal(from_bf16, from_float), f"{ISA_NAMES[isa]} {dtype}"


@pytest.mark.parametrize("shape", [(1, 37, 32), (70, 96, 1152), (17, 64, 50)], ids=lambda s: "M{}-K{}-N{}".format(*s))
def test_bfloat16_product_output_is_the_float_output_rounded(kernels, shape: tuple[int, int, int]) -> None:
    """packed_linear's bf16_out (an encoder's fused QKV; on AMX from the tiles' epilogue where N is a
    multiple of 32) holds the float32 output's bits rounded to nearest-even."""
    m, k, n = shape
    gen = torch.Generator().manual_seed(13 * m + n)
    weight, bias, x = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen), torch.randn(m, k, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        packed = PackedWeight.pack(weight, bias, dtype)
        for isa in range(kernels.best_isa() + 1):
            for b in (packed.bias, None):
                wide = kernels.packed_linear(x, packed.data, None, b, n, isa)
                narrow = kernels.packed_linear(x, packed.data, None, b, n, isa, True)
                assert narrow.dtype == torch.bfloat16 and narrow.shape == (m, n)
                assert torch.equal(narrow, wide.bfloat16()), f"{ISA_NAMES[isa]} {dtype} bias={b is not None}"


@pytest.mark.parametrize("shape", [(600, 64, 96), (70, 96, 384), (2048, 384, 384)], ids=lambda s: "M{}-K{}-N{}".format(*s))
def test_add_norm_on_bfloat16_panels_norms_every_row_once(kernels, shape: tuple[int, int, int]) -> None:
    """bfloat16 panels at an encoder step's sizes (2,048 rows: the AMX products' row-block tasks),
    x float32 or bfloat16: every row is the LayerNorm of its sum, once."""
    m, k, n = shape
    gen = torch.Generator().manual_seed(17 * m + n)
    weight, bias, x = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen), torch.randn(m, k, generator=gen)
    residual = torch.randn(m, n, generator=gen) * 2
    norm_weight, norm_bias = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    packed = PackedWeight.pack(weight, bias, torch.bfloat16)
    for isa in range(kernels.best_isa() + 1):
        for given in (x, x.bfloat16()):
            # what the product reads: x rounded on the bfloat16 paths, and bfloat16 x everywhere
            xr = (x.bfloat16() if isa >= ISAS["avx512_bf16"] or given.dtype == torch.bfloat16 else x).double()
            expected = F.layer_norm(residual.double() + xr @ weight.bfloat16().double().T + bias.double(), (n,),
                                    norm_weight.double(), norm_bias.double(), 1e-12)
            out = residual.clone()
            kernels.packed_linear_add_norm_(given, packed.data, packed.bias, n, isa, out, norm_weight, norm_bias, 1e-12)
            err = (out.double() - expected).abs().max().item()
            assert err < 1e-3, f"{ISA_NAMES[isa]} {given.dtype}: max error {err}"
