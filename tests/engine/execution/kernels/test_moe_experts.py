"""The C++ MoE experts op (PackedExperts) against models/moe.py's torch Experts on random shapes:
float32 panels within 1e-5 of it, bfloat16 and int8 panels and GGUF blocks (Q4_0, Q8_0, Q4_K, Q6_K
and gpt-oss's MXFP4) against their dequantized float weights, both activations, with and without
biases, on every SIMD path this CPU runs (scalar, AVX2 forced on AVX-512 machines, AVX-512). An
unrouted expert's panels are never read: filled with NaN, the output stays finite."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from torch import nn

from bench.random_blocks import random_blocks
from engine.execution.backends.cpu_moe import PackedExperts, pack_moe_experts
from engine.execution.kernels import ISAS
from engine.execution.models.moe import Experts, MoeConfig, SparseMoe, gated
from engine.execution.weights.quantized_weight import QuantizedWeight
from tests.engine.execution.kernels.test_quant_kernels import quantized_rows
from tests.helpers import ISA_NAMES

T = GGMLQuantizationType
NUM_EXPERTS = 8
BF16_PRODUCTS = ISAS["avx512_bf16"]  # from here up, bf16 panels multiply x rounded to bf16


def _isas(kernels) -> list[int]:
    return list(range(kernels.best_isa() + 1))


def _config(k: int, intermediate: int, activation: str, bias: bool) -> MoeConfig:
    return MoeConfig(num_experts=NUM_EXPERTS, num_experts_per_tok=k, intermediate_size=intermediate,
                     activation=activation, expert_bias=bias, swiglu_limit=1.5)  # a limit the values cross


def _random_experts(cfg: MoeConfig, hidden: int, seed: int) -> Experts:
    g = torch.Generator().manual_seed(seed)
    experts = Experts(cfg, hidden)
    with torch.no_grad():
        experts.gate_up.copy_(torch.randn(experts.gate_up.shape, generator=g) / hidden**0.5)
        experts.down.copy_(torch.randn(experts.down.shape, generator=g) / cfg.intermediate_size**0.5)
        if cfg.expert_bias:
            experts.gate_up_bias.copy_(torch.randn(experts.gate_up_bias.shape, generator=g) * 0.1)
            experts.down_bias.copy_(torch.randn(experts.down_bias.shape, generator=g) * 0.1)
    return experts


def _routes(num_tokens: int, k: int, seed: int, num_experts: int = NUM_EXPERTS) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token (of the first num_experts) and positive weights: [T, k] int64, [T, k] float32."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(num_tokens, num_experts, generator=g).argsort(dim=-1)[:, :k]
    weights = torch.softmax(torch.randn(num_tokens, k, generator=g), dim=-1)
    return ids, weights


def _reference64(experts: Experts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 quantize_acts: bool = False) -> np.ndarray:
    """The experts in float64, each expert's output weighted and summed per token; quantize_acts: each
    product's input rounded per 32 k to int8 first, as the integer-dot kernels round it."""
    cfg = experts.cfg
    out = np.zeros(tuple(x.shape))
    xs = x.double().numpy()
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            row = quantized_rows(xs[t:t + 1].astype(np.float32)) if quantize_acts else xs[t:t + 1]
            h = row @ experts.gate_up[e].double().numpy().T
            if experts.gate_up_bias is not None:
                h = h + experts.gate_up_bias[e].double().numpy()
            a = gated(torch.from_numpy(h), cfg).numpy()
            if quantize_acts:
                a = quantized_rows(a.astype(np.float32))
            y = a @ experts.down[e].double().numpy().T
            if experts.down_bias is not None:
                y = y + experts.down_bias[e].double().numpy()
            out[t] += float(weights[t, j]) * y[0]
    return out


# (tokens, experts per token): T = 1, 3, 17 and k = 1..4
ROUTES = [(1, 1), (1, 4), (3, 2), (3, 3), (17, 1), (17, 4)]


@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("route", ROUTES, ids=lambda r: "T{}-k{}".format(*r))
def test_float32_panels_match_the_torch_experts(kernels, activation: str, bias: bool, route: tuple[int, int]) -> None:
    num_tokens, k = route
    hidden, intermediate = 50, 37  # ragged: 2I = 74 and H = 50 end in partial panels
    cfg = _config(k, intermediate, activation, bias)
    experts = _random_experts(cfg, hidden, seed=num_tokens * 10 + k)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(k))
    ids, weights = _routes(num_tokens, k, seed=num_tokens + k)
    expected = experts(x, ids, weights)
    for isa in _isas(kernels):
        packed = PackedExperts.from_experts(experts, torch.float32, kernels, isa)
        out = packed(x, ids, weights)
        assert out.shape == (num_tokens, hidden) and out.dtype == torch.float32
        err = (out - expected).abs().max().item()
        assert err <= 1e-5 * expected.abs().max().item(), f"{ISA_NAMES[isa]}: max error {err}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8], ids=["bf16", "int8"])
@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
@pytest.mark.parametrize("route", [(1, 4), (3, 2), (17, 3)], ids=lambda r: "T{}-k{}".format(*r))
def test_narrow_panels_match_their_rounded_weights(kernels, dtype: torch.dtype, activation: str,
                                                   route: tuple[int, int]) -> None:
    num_tokens, k = route
    hidden, intermediate = 64, 40
    cfg = _config(k, intermediate, activation, True)
    experts = _random_experts(cfg, hidden, seed=3)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(5))
    ids, weights = _routes(num_tokens, k, seed=7)
    for isa in _isas(kernels):
        packed = PackedExperts.from_experts(experts, dtype, kernels, isa)
        rounded = Experts(cfg, hidden)  # the weights the panels hold
        with torch.no_grad():
            rounded.gate_up.copy_(torch.stack([w.dequantize() for w in packed.gate_up_panels]))
            rounded.down.copy_(torch.stack([w.dequantize() for w in packed.down_panels]))
            rounded.gate_up_bias.copy_(experts.gate_up_bias)
            rounded.down_bias.copy_(experts.down_bias)
        expected = _reference64(rounded, x, ids, weights)
        # vdpbf16ps rounds each product's input to bf16 (as torch's bf16 path does): 0.4 % a value
        tolerance = 1e-2 if dtype == torch.bfloat16 and isa >= BF16_PRODUCTS else 1e-5
        err = np.abs(packed(x, ids, weights).double().numpy() - expected).max()
        assert err <= tolerance * np.abs(expected).max(), f"{ISA_NAMES[isa]}: max error {err}"


def _quantized_experts(cfg: MoeConfig, hidden: int, quant_type: T, seed: int) -> tuple[Experts, Experts]:
    """(a float Experts of the blocks' dequantized weights, the same experts as a GGUF load leaves
    them: float parameters on the meta device, the blocks in quantized_gate_up / quantized_down)."""
    rng = np.random.default_rng(seed)
    intermediate = cfg.intermediate_size
    gate_up = [QuantizedWeight.pack(random_blocks(quant_type, 2 * intermediate, hidden, rng), quant_type, hidden)
               for _ in range(cfg.num_experts)]
    down = [QuantizedWeight.pack(random_blocks(quant_type, hidden, intermediate, rng), quant_type, intermediate)
            for _ in range(cfg.num_experts)]
    reference = _random_experts(cfg, hidden, seed)  # its biases are the loaded ones
    with torch.no_grad():
        reference.gate_up.copy_(torch.stack([w.dequantize() for w in gate_up]))
        reference.down.copy_(torch.stack([w.dequantize() for w in down]))
    with torch.device("meta"):
        loaded = Experts(cfg, hidden)
    if cfg.expert_bias:
        loaded.gate_up_bias = nn.Parameter(reference.gate_up_bias.clone(), requires_grad=False)
        loaded.down_bias = nn.Parameter(reference.down_bias.clone(), requires_grad=False)
    loaded.quantized_gate_up, loaded.quantized_down = gate_up, down
    return reference, loaded


@pytest.mark.parametrize("quant_type", [T.Q4_0, T.Q8_0, T.Q4_K, T.Q6_K, T.MXFP4], ids=lambda t: t.name)
@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("route", [(1, 4), (3, 2), (17, 3)], ids=lambda r: "T{}-k{}".format(*r))
def test_gguf_blocks_match_the_dequantized_experts(kernels, quant_type: T, activation: str, bias: bool,
                                                   route: tuple[int, int]) -> None:
    num_tokens, k = route
    # multiples of the block size, not of the 16-row panel's products: 2I and H in several panels
    hidden, intermediate = (512, 256) if quant_type in (T.Q4_K, T.Q6_K) else (96, 160)
    cfg = _config(k, intermediate, activation, bias)
    reference, loaded = _quantized_experts(cfg, hidden, quant_type, seed=int(quant_type) + num_tokens)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(11))
    ids, weights = _routes(num_tokens, k, seed=13 + num_tokens)
    floats = reference(x, ids, weights).double().numpy()  # the torch Experts on the dequantized weights
    exact = _reference64(reference, x, ids, weights, quantize_acts=True)
    for isa in _isas(kernels):
        out = PackedExperts.from_experts(loaded, torch.float32, kernels, isa)(x, ids, weights).double().numpy()
        # the activations' int8 rounding is the only one the kernels add (the dense kernels' 1e-5)
        assert np.abs(out - exact).max() <= 1e-5 * np.abs(exact).max(), ISA_NAMES[isa]
        # and per-block int8 activations: a small share of each output's size (the dense kernels'
        # bound, 2 % of the largest output, once for each of the two products in a row)
        assert np.abs(out - floats).max() < 0.04 * np.abs(floats).max(), ISA_NAMES[isa]


@pytest.mark.parametrize("kind", ["fp32", "Q4_0"])
def test_an_unrouted_experts_panels_are_not_read(kernels, kind: str) -> None:
    num_tokens, k, hidden, intermediate = 17, 4, 64, 64
    cfg = _config(k, intermediate, "silu", False)
    if kind == "fp32":
        experts = _random_experts(cfg, hidden, seed=1)
        packed = PackedExperts.from_experts(experts, torch.float32, kernels, kernels.best_isa())
        nan = float("nan")
    else:
        experts, loaded = _quantized_experts(cfg, hidden, T.Q4_0, seed=1)
        packed = PackedExperts.from_experts(loaded, torch.float32, kernels, kernels.best_isa())
        nan = 0xFF  # every float16 scale 0xFFFF: NaN
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(2))
    ids, weights = _routes(num_tokens, k, seed=3, num_experts=NUM_EXPERTS - 1)  # never the last expert
    expected = packed(x, ids, weights)
    packed.gate_up_panels[-1].data.fill_(nan)  # the op holds these very tensors
    packed.down_panels[-1].data.fill_(nan)
    out = packed(x, ids, weights)
    assert torch.isfinite(out).all() and torch.equal(out, expected)
    # the check can fail: routed to the poisoned expert, a token's output is NaN
    ids[0, 0] = NUM_EXPERTS - 1
    assert torch.isnan(packed(x, ids, weights)[0]).all()


def test_repeated_calls_give_the_same_bits(kernels) -> None:
    """The threads race for tasks, but each token's experts are summed in ascending order after
    the products: the output does not depend on which thread ran what."""
    cfg = _config(4, 48, "silu", True)
    experts = _random_experts(cfg, 64, seed=9)
    packed = PackedExperts.from_experts(experts, torch.float32, kernels, kernels.best_isa())
    x = torch.randn(17, 64, generator=torch.Generator().manual_seed(1))
    ids, weights = _routes(17, 4, seed=2)
    first = packed(x, ids, weights)
    for _ in range(5):
        assert torch.equal(packed(x, ids, weights), first)


def test_bad_inputs_are_refused(kernels) -> None:
    cfg = _config(2, 32, "silu", False)
    packed = PackedExperts.from_experts(_random_experts(cfg, 32, seed=0), torch.float32, kernels, kernels.best_isa())
    x = torch.randn(2, 32)
    ids, weights = _routes(2, 2, seed=0)
    with pytest.raises(RuntimeError, match="outside 8 experts"):
        packed(x, ids + NUM_EXPERTS, weights)
    with pytest.raises(RuntimeError, match="x must be"):
        packed(torch.randn(2, 31), ids, weights)
    with pytest.raises(RuntimeError, match="int64"):
        packed(x, ids.int(), weights)
    with pytest.raises(ValueError, match="panels for 8 experts"):
        PackedExperts(cfg, 32, packed.gate_up_panels[:3], packed.down_panels, kernels, kernels.best_isa())


def test_pack_moe_experts_swaps_every_sparse_moe(kernels) -> None:
    cfg = _config(2, 32, "swiglu_oai", True)
    model = nn.ModuleList([SparseMoe(cfg, 48), SparseMoe(cfg, 48)])
    for moe in model:
        moe.experts = _random_experts(cfg, 48, seed=4)
        nn.init.normal_(moe.router.weight)
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(0))
    expected = [moe(x) for moe in model]
    packed = pack_moe_experts(model, torch.float32, kernels, kernels.best_isa())
    assert len(packed) == 2 and all(isinstance(moe.experts, PackedExperts) for moe in model)
    for moe, want in zip(model, expected, strict=True):
        torch.testing.assert_close(moe(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("routing", "norm_topk_prob"), [("softmax_topk", True), ("softmax_topk", False),
                                                          ("topk_softmax", False)])
def test_the_fused_layers_routing_matches_the_modules(kernels, routing: str, norm_topk_prob: bool) -> None:
    """kernels.moe_route (the fused layers' routing) picks the experts SparseMoe.route picks, with
    its weights: Qwen3-MoE's softmax then top k (renormalised or not), gpt-oss's top k then softmax."""
    from engine.execution.backends.cpu_fused import ROUTINGS

    cfg = MoeConfig(num_experts=16, num_experts_per_tok=4, intermediate_size=8, routing=routing,
                    norm_topk_prob=norm_topk_prob)
    moe = SparseMoe(cfg, hidden_size=16)
    moe.router.weight.data = torch.eye(16)  # the router's logits are x itself
    logits = torch.randn(37, 16, generator=torch.Generator().manual_seed(0)) * 3  # [T, E]
    ids, weights = kernels.moe_route(logits, 4, ROUTINGS[routing], norm_topk_prob)
    want_ids, want_weights = moe.route(logits)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-7)
    with pytest.raises(RuntimeError, match="unknown routing"):
        kernels.moe_route(logits, 4, 2, False)
