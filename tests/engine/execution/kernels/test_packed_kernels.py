"""The small-batch C++ kernels against torch references: the packed matrix product in float32,
bfloat16 and int8 on odd shapes (M = 1, 3, 17; K and N not multiples of the vector width) on
every SIMD path this CPU runs (AVX2 is forced on AVX-512 machines), and one whole decoder layer
in one call against the torch layer it replaces."""
from __future__ import annotations

import itertools
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from engine.execution.attention import AttentionMetadata
from engine.execution.backends.cpu_attention import CpuAttention
from engine.execution.backends.cpu_fused import FusedLayer
from engine.execution.backends.cpu_linear import PackedLinear
from engine.execution.kernels import ISAS
from engine.execution.models.layers import RMSNorm
from engine.execution.models.llama import DecoderLayer
from engine.execution.models.model_config import ModelConfig, Rope
from engine.execution.resolved_config import pick_isa
from engine.execution.weights.packed_weight import PackedWeight
from tests.helpers import ISA_NAMES

BF16_PRODUCTS = ISAS["avx512_bf16"]  # from here up, bf16 products: vdpbf16ps, then the AMX tiles


def _isas(kernels) -> list[int]:
    return list(range(kernels.best_isa() + 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=["fp32", "bf16", "int8"])
# N = 984: 62 panels, so tasks take several and the two-panel tiles run, the last pair ending in
# a partial panel; M = 6 and 21 give them tiles of 6, 8 and 5 rows. Odd K leaves bf16's last
# pair half used; on AMX, M = 21 and 40 leave row blocks of 5 and 8 rows, K = 33 and 577 a
# padded last tile of k. int8 panels take tiles of up to 10 rows, one panel at a time on AVX-512:
# M = 9, 17 and 21 give tiles of 9; 10 and 7; 10, 10 and 1. On AMX (amx_split, 2 threads as
# set below), M = 600 with 37 panels is one run of all the panels (a lone last one) over row
# blocks of 64, two tile blocks each, the last 24 rows; K = 1536 with 30 panels, runs of 16 and 14
# over row blocks of 32, the last 4 rows.
@pytest.mark.parametrize("shape", [(1, 37, 20), (3, 64, 48), (17, 100, 33), (9, 576, 960), (6, 50, 984),
                                   (21, 33, 984), (40, 577, 50), (600, 64, 592), (100, 1536, 480)],
                         ids=lambda s: "M{}-K{}-N{}".format(*s))
def test_packed_linear_matches_the_matrix_it_packs(kernels, dtype: torch.dtype, shape: tuple[int, int, int]) -> None:
    m, k, n = shape
    gen = torch.Generator().manual_seed(m * 1000 + k)
    weight, bias, x = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen), torch.randn(m, k, generator=gen)
    packed = PackedWeight.pack(weight, bias, dtype)
    reference = x.double() @ packed.dequantize().double().T + bias.double()
    # vdpbf16ps and AMX multiply bf16 weights by x rounded to bf16 (as torch's bf16 path does),
    # summed in fp32.
    rounded = x.bfloat16().double() @ packed.dequantize().double().T + bias.double()
    num_threads = torch.get_num_threads()
    for isa in _isas(kernels):
        torch.set_num_threads(2)  # the task splits the comment above describes
        try:
            out = kernels.packed_linear(x, *packed.as_args(), isa)
        finally:
            torch.set_num_threads(num_threads)
        expected = rounded if isa >= BF16_PRODUCTS and dtype == torch.bfloat16 else reference
        assert out.shape == (m, n)
        err = (out.double() - expected).abs().max().item()
        assert err < 1e-3 * k**0.5, f"{ISA_NAMES[isa]}: max error {err}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=["fp32", "bf16", "int8"])
def test_packed_linear_of_no_rows_is_empty_on_every_path(kernels, dtype: torch.dtype) -> None:
    """An empty batch: [0, n] out, nothing computed (amx_split divided by its zero row blocks)."""
    packed = PackedWeight.pack(torch.randn(40, 24), torch.randn(40), dtype)
    for isa in _isas(kernels):
        assert kernels.packed_linear(torch.randn(0, 24), *packed.as_args(), isa).shape == (0, 40), ISA_NAMES[isa]


def test_packing_keeps_fp32_exact_and_int8_within_half_a_step() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 24, generator=gen) * torch.linspace(0.01, 3, 40).unsqueeze(1)  # rows of different range
    assert torch.equal(PackedWeight.pack(weight, None, torch.float32).dequantize(), weight)
    bf16 = PackedWeight.pack(weight[:, :23], None, torch.bfloat16)  # odd K: pairs of k, padded to 32
    assert bf16.data.shape == (3, 16, 32)
    assert torch.equal(bf16.dequantize(), weight[:, :23].bfloat16().float())
    q = PackedWeight.pack(weight, None, torch.int8)
    step = weight.abs().amax(dim=1, keepdim=True) / 127  # one scale per output channel
    assert ((q.dequantize() - weight).abs() <= step / 2 + 1e-7).all()
    assert q.num_bytes == 48 * 24 + 48 * 4  # int8 plus one float32 scale per channel, padded to 48
    with pytest.raises(ValueError, match="float32, bfloat16 or int8"):
        PackedWeight.pack(weight, None, torch.float16)


def test_isa_choice_refuses_unknown_and_unsupported_names(kernels) -> None:
    assert pick_isa(kernels, "auto") == kernels.best_isa()
    assert pick_isa(kernels, "scalar") == 0
    assert pick_isa(None, "avx512") == 0  # no kernels, nothing to choose
    with pytest.raises(ValueError, match="MINIVLLM_KERNEL_ISA"):
        pick_isa(kernels, "sse2")
    avx2_only = SimpleNamespace(best_isa=lambda: 1)  # an AVX2 machine, whatever this one is
    assert pick_isa(avx2_only, "auto") == 1
    with pytest.raises(ValueError, match="does not run it"):
        pick_isa(avx2_only, "avx512")


# The layer recipes of the families (ModelConfig's fields beyond Llama's): Qwen3's per-head q/k
# norms; Gemma 3's too, with its norms of o_proj's and down's outputs, GeGLU and its own softmax scale.
LAYER_FAMILIES = {"llama": {}, "qwen3": {"qk_norm": True},
                  "gemma3": {"qk_norm": True, "sandwich_norms": True, "hidden_act": "gelu_tanh", "attn_scale": 0.3}}


def _torch_layer(layer, *args) -> torch.Tensor:
    """The layer's torch reference: F.linear on the same weights (its panels set aside meanwhile)."""
    projections = layer.projections
    panels = [proj.panels for proj in projections]
    for proj in projections:
        proj.panels = None
    try:
        with torch.inference_mode():
            return layer(*args)
    finally:
        for proj, saved in zip(projections, panels, strict=True):
            proj.panels = saved


def _layer_case(weight_dtype: torch.dtype, window: int | None, kernels, isa: int, family: str = "llama",
                rope_index: int = 0):
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=48, intermediate_size=80, num_layers=1,
                      num_heads=6, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, max_position_embeddings=512,
                      tie_word_embeddings=False, qkv_bias=True, o_proj_bias=False,
                      ropes=(Rope(torch.ones(4), 1.0),) * (rope_index + 1), layer_ropes=(rope_index,),
                      sliding_windows=(window,), **LAYER_FAMILIES[family])
    torch.manual_seed(1)
    layer = DecoderLayer(cfg, 0)
    for name, p in layer.named_parameters():
        if name.endswith("norm.weight"):
            p.data.uniform_(0.5, 1.5)
        else:
            p.data.normal_(0, 0.3)
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        proj = PackedLinear(getattr(layer, name))  # as the CPU backend swaps it in
        proj.pack_panels(weight_dtype, kernels, isa, max_panel_rows=8)
        proj.weight.data.copy_(proj.panels.dequantize())  # the torch path runs the same (quantized) weights
        setattr(layer, name, proj)
    return cfg, layer, FusedLayer.of(layer, kernels)


@pytest.mark.parametrize("family", list(LAYER_FAMILIES))
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16, torch.int8], ids=["fp32", "bf16", "int8"])
@pytest.mark.parametrize("window", [None, 5], ids=["full", "window5"])
def test_decode_layer_in_one_call_matches_the_torch_layer(kernels, weight_dtype: torch.dtype,
                                                          window: int | None, family: str) -> None:
    bs, num_blocks, batch = 4, 24, 4
    lens = torch.tensor([1, 9, 14, 6])  # tokens in the cache after this step, the new one included
    tables = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(2))[: batch * 4].view(batch, 4)
    positions = lens - 1
    slots = tables[torch.arange(batch), positions // bs] * bs + positions % bs
    num_threads = torch.get_num_threads()
    # 2 threads: one attention task per (sequence, KV head); 1 thread: 4 rows fill it, one per sequence.
    for isa, threads in [(isa, t) for isa in _isas(kernels) for t in (2, 1)]:
        torch.set_num_threads(threads)
        cfg, layer, fused = _layer_case(weight_dtype, window, kernels, isa, family)
        gen = torch.Generator().manual_seed(3)
        k_cache = torch.randn(num_blocks * bs, cfg.num_kv_heads, cfg.head_dim, generator=gen)
        v_cache = torch.randn(num_blocks * bs, cfg.num_kv_heads, cfg.head_dim, generator=gen)
        x = torch.randn(batch, cfg.hidden_size, generator=gen)
        freqs = positions.float().unsqueeze(1) * torch.linspace(1, 0.01, cfg.head_dim // 2).unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, D]
        cos, sin = emb.cos(), emb.sin()
        attn = AttentionMetadata(slot_mapping=slots, block_size=bs, block_tables=tables, context_lens=lens,
                                 backend=CpuAttention(kernels, 0, prefill_in_cpp=False))
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        expected = _torch_layer(layer, x, cos.unsqueeze(1), sin.unsqueeze(1), attn, k_ref, v_ref)
        with torch.inference_mode():
            out = x.clone()
            fused.forward(out, cos, sin, attn, k_cache, v_cache, kernels, isa)
        torch.set_num_threads(num_threads)
        # bf16 products (vdpbf16ps, AMX) round the activations to bf16: 0.44 % of the largest
        # output here; a lost residual would be off by the size of x (up to about 3), a wrong
        # row by the outputs' own size.
        is_rounded = weight_dtype == torch.bfloat16 and isa >= BF16_PRODUCTS
        atol = 1e-2 * expected.abs().max().item() if is_rounded else 1e-4
        assert torch.allclose(out, expected, atol=atol), f"{ISA_NAMES[isa]}, {threads} threads: {(out - expected).abs().max()} of {expected.abs().max()}"
        cache_atol = 1e-2 * max(k_ref.abs().max().item(), v_ref.abs().max().item()) if is_rounded else 1e-5
        assert torch.allclose(k_cache, k_ref, atol=cache_atol) and torch.allclose(v_cache, v_ref, atol=cache_atol)
        assert not torch.equal(k_cache[slots], torch.zeros_like(k_cache[slots]))


def test_a_team_member_takes_its_home_range_in_order_then_the_others_from_the_back(kernels) -> None:
    """DecodeModel's products: rank r's home is the r-th of num_ranks even slices of a part's
    tasks; a member walks its own in order (one run of weights), then takes each other rank's
    from the back, so a preempted member's tasks still run, each once (a task run twice would
    add its product into the residual twice)."""
    assert kernels.team_task_order(10, 3, 0) == [0, 1, 2, 5, 4, 3, 9, 8, 7, 6]
    assert kernels.team_task_order(10, 3, 1) == [3, 4, 5, 9, 8, 7, 6, 2, 1, 0]
    assert kernels.team_task_order(2, 3, 2) == [1, 0]  # rank 0's home is empty
    assert kernels.team_task_order(0, 2, 1) == []
    for num_tasks in (1, 7, 64, 97):
        for num_ranks in (1, 2, 3, 5):
            for rank in range(num_ranks):
                assert sorted(kernels.team_task_order(num_tasks, num_ranks, rank)) == list(range(num_tasks))
    with pytest.raises(RuntimeError, match="team_task_order: 0 <= rank < num_ranks"):
        kernels.team_task_order(4, 2, 2)


def test_a_few_row_product_splits_each_home_into_tasks_that_shrink_to_its_back(kernels) -> None:
    """A team's few-row products: rank r's home is panels [r P / R, (r + 1) P / R), taken from the
    front by its owner and from the back by the others, so its tasks shrink towards the back
    (the member that runs out first takes small ones and the part ends with both at work)."""
    tasks = kernels.tapered_split(192, 2)  # gate/up at hidden 576: 96 panels a home
    assert tasks[:8] == [(0, 24), (24, 48), (48, 72), (72, 84), (84, 90), (90, 93), (93, 95), (95, 96)]
    assert tasks[8:] == [(96 + a, 96 + b) for a, b in tasks[:8]]
    assert kernels.tapered_split(1, 1) == [(0, 1)]
    assert kernels.tapered_split(1, 2) == [(0, 0), (0, 1)]  # rank 0's home is empty
    for num_panels in (1, 2, 3, 7, 36, 60, 97, 3072):
        for num_ranks in (1, 2, 3, 5):
            tasks = kernels.tapered_split(num_panels, num_ranks)
            per_home = len(tasks) // num_ranks
            assert len(tasks) == per_home * num_ranks
            for rank in range(num_ranks):
                home = tasks[rank * per_home:(rank + 1) * per_home]
                begin, end = rank * num_panels // num_ranks, (rank + 1) * num_panels // num_ranks
                assert home[0][0] == begin and home[-1][1] == end
                assert all(a[1] == b[0] for a, b in itertools.pairwise(home))  # in order, each panel once
                sizes = [b - a for a, b in home if b > a]
                assert sizes == sorted(sizes, reverse=True)
                assert not sizes or (sizes[-1] == 1 and sizes[0] <= max(1, (end - begin + 3) // 4))
    with pytest.raises(RuntimeError, match="tapered_split: num_panels >= 0, num_ranks > 0"):
        kernels.tapered_split(4, 0)


def _three_fused_layers(kernels, isa: int) -> tuple[ModelConfig, list]:
    """A full, a window-5 and a full float32 layer (seeded), and their config."""
    layers = []
    for i, window in enumerate((None, 5, None)):
        torch.manual_seed(10 + i)
        layers.append(_layer_case(torch.float32, window, kernels, isa)[2])
    return _layer_case(torch.float32, None, kernels, isa)[0], layers


@pytest.mark.parametrize("embedding_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_model_step_is_the_embedding_every_layer_the_norm_and_the_head(kernels, embedding_dtype) -> None:
    """The model's decode step in one call (DecodeModel.step): the embedding's and RoPE tables' rows of the tokens,
    the same floats as one decode_layer call per layer (each layer with its own weights, window
    and caches), the final RMSNorm, the LM head's panels, and torch.argmax's choice per row; on a
    team of 1, 2, 3 or 4 threads (3 and 4 on a 2-core machine, where members are likely
    preempted mid-step and may find parts done without them: 4 five times over; nothing here
    forces or observes that, and a narrow ordering race can pass), whose attention tasks are
    whole rows (8 rows, 1 or 2 threads) or one KV head of a row (3, 4)."""
    bs, num_blocks, vocab, max_positions = 4, 40, 70, 20  # vocab: past the argmax's 32-wide steps
    lens = torch.tensor([1, 9, 14, 3, 7, 12, 5, 10])
    batch = len(lens)
    tables = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(6))[: batch * 4].view(batch, 4)
    positions = lens - 1
    slots = tables[torch.arange(batch), positions // bs] * bs + positions % bs
    isa = kernels.best_isa()
    cfg, layers = _three_fused_layers(kernels, isa)
    gen = torch.Generator().manual_seed(7)
    caches = [(torch.randn(num_blocks * bs, cfg.num_kv_heads, cfg.head_dim, generator=gen),
               torch.randn(num_blocks * bs, cfg.num_kv_heads, cfg.head_dim, generator=gen)) for _ in layers]
    embedding = torch.randn(vocab, cfg.hidden_size, generator=gen).to(embedding_dtype)
    token_ids = torch.tensor([5, 69, 0, 12, 33, 47, 8, 21])
    freqs = torch.arange(max_positions).float().unsqueeze(1) * torch.linspace(1, 0.01, cfg.head_dim // 2)
    cos_table, sin_table = freqs.cos(), freqs.sin()  # [max_positions, D / 2], as the model keeps them
    attn = AttentionMetadata(slot_mapping=slots, block_size=bs, block_tables=tables, context_lens=lens,
                             backend=CpuAttention(kernels, 0, prefill_in_cpp=False))
    final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    final_norm.weight.copy_(torch.rand(cfg.hidden_size, generator=gen) + 0.5)
    weights = [layer.weights for layer in layers]

    def reference(threads: int) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        # One call per layer, as mixed steps run, on as many threads: a product's task split, and so
        # which panels share a tile, follows the thread count, and with it the last bits of a row.
        hidden = embedding[token_ids].float()
        ref_caches = [(k.clone(), v.clone()) for k, v in caches]
        num_threads = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            for layer, (k, v) in zip(layers, ref_caches, strict=True):
                layer.forward(hidden, cos_table[positions].repeat(1, 2), sin_table[positions].repeat(1, 2), attn, k, v,
                              kernels, isa)
        finally:
            torch.set_num_threads(num_threads)
        return final_norm(hidden), ref_caches

    made_decoders = []

    def step(head_weight: torch.Tensor, with_argmax: bool = True, step_isa: int = isa, threads: int = 2, **changes):
        # As the sequences hold them: block tables as long as each context needs (padded inside).
        args = dict(token_ids=token_ids.tolist(), tables=[t[: (n - 1) // bs + 1] for t, n in zip(
                    tables.tolist(), lens.tolist(), strict=True)], lens=lens.tolist(), embedding=embedding,
                    cos=cos_table, sin=sin_table, caches=[(k.clone(), v.clone()) for k, v in caches],
                    final_norm=final_norm.weight)
        args |= changes
        head = PackedWeight.pack(head_weight, None, torch.float32)
        decoder = kernels.DecodeModel(args["embedding"], [args["cos"]], [args["sin"]], weights, args["caches"],
                                      args["final_norm"], head.as_args(), cfg.num_heads, bs, cfg.rms_norm_eps,
                                      cfg.head_dim**-0.5, 0, None, step_isa, [0] * len(weights))
        made_decoders.append(decoder)
        num_threads = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            logits, ids = decoder.step(args["token_ids"], [args["tables"]], args["lens"], with_argmax)
        finally:
            torch.set_num_threads(num_threads)
        return logits, ids, head, args["caches"]

    head_weight = torch.randn(vocab, cfg.hidden_size, generator=gen)
    for threads in (1, 3, 4, 4, 4, 4, 4, 2):
        normed, ref_caches = reference(threads)
        logits, ids, head, stepped = step(head_weight, threads=threads)
        assert torch.allclose(logits, kernels.packed_linear(normed, *head.as_args(), isa), atol=1e-5), threads
        assert ids == logits.argmax(dim=-1).tolist(), threads
        # Each layer's new K and V rows: bit-equal to the per-layer calls' (every row-wise part
        # splits at the vector width, so each float takes the same path on any team).
        assert [[torch.equal(a, b) for a, b in zip(kv, kv_ref, strict=True)] for kv, kv_ref in zip(
            stepped, ref_caches, strict=True)] == [[True, True]] * len(layers), threads
    assert step(head_weight, with_argmax=False)[1] is None
    # The step's own split (the benchmark's per-token split): each kind of part's wall time, the
    # steps counted, the kinds adding up to no more than the calls took; reading zeroes them.
    decoder = made_decoders[-1]
    assert decoder.take_part_seconds()["argmax"] == 0.0  # its one step ran no argmax
    step_args = (token_ids.tolist(), [[t[: (n - 1) // bs + 1] for t, n in zip(tables.tolist(), lens.tolist(),
                                                                              strict=True)]], lens.tolist())
    start = time.perf_counter()
    for with_argmax in (True, True, False):
        decoder.step(*step_args, with_argmax)
    wall = time.perf_counter() - start
    parts = decoder.take_part_seconds()
    assert parts.pop("steps") == 3
    assert list(parts) == ["qkv", "attention", "o_proj", "gate_up", "silu", "down", "lm_head", "argmax", "outside"]
    assert min(parts.values()) > 0 and 0.3 * wall < sum(parts.values()) <= wall
    assert decoder.take_part_seconds() == dict.fromkeys(["steps", *parts], 0)
    # Ties go to the first maximum (two equal rows of the head, 3 and 7, far ahead of the rest),
    # then the last column wins alone; a NaN wins over any number, the first NaN (5, not 9).
    direction = normed / normed.norm(dim=1, keepdim=True)
    ties = head_weight.clone()
    ties[3] = ties[7] = 100 * direction[0]
    ties[68] = 100 * direction[2]
    nans = head_weight.clone()
    nans[[5, 9]] = float("nan")
    for step_isa in sorted({0, isa}):  # the argmax's scalar loop and its AVX-512 one where the CPU has it
        logits, ids, _, _ = step(ties, step_isa=step_isa)
        assert logits[0, 3] == logits[0, 7] == logits[0].max() and logits[2, 68] == logits[2].max()
        assert ids[0] == 3 and ids[2] == 68 and ids == logits.argmax(dim=-1).tolist(), ISA_NAMES[step_isa]
        logits, ids, _, _ = step(nans, step_isa=step_isa)
        assert ids == [5] * batch == logits.argmax(dim=-1).tolist(), ISA_NAMES[step_isa]
    # A tied LM head holds the embedding: read from its float32 or bfloat16 panels, the rows are the
    # table's own, so the step is the same float for float.
    for panel_dtype in (torch.float32, torch.bfloat16):
        panels = PackedWeight.pack(embedding.float(), None, panel_dtype)
        from_panels = step(head_weight, embedding=panels.data)[0]
        assert torch.equal(from_panels, step(head_weight, embedding=panels.dequantize().contiguous())[0]), panel_dtype
        with pytest.raises(RuntimeError, match="embedding index 75 out of \\[0, 70\\)"):  # a panel's padded row
            step(head_weight, embedding=panels.data, token_ids=[5, 75] + token_ids.tolist()[2:])
    with pytest.raises(RuntimeError, match="one \\(K, V\\) cache pair per layer"):
        step(head_weight, caches=caches[:1])
    with pytest.raises(RuntimeError, match="embedding index 70 out of \\[0, 70\\)"):
        step(head_weight, token_ids=[5, 70] + token_ids.tolist()[2:])
    with pytest.raises(RuntimeError, match="RoPE table index 13 out of \\[0, 10\\)"):
        step(head_weight, cos=cos_table[:10], sin=sin_table[:10])
    with pytest.raises(RuntimeError, match="context length 17 outside its block table"):
        step(head_weight, lens=[1, 9, 17] + lens.tolist()[3:])
    with pytest.raises(RuntimeError, match="block 40 outside the cache"):
        step(head_weight, tables=[[40]] + [t[: (n - 1) // bs + 1] for t, n in zip(
             tables.tolist()[1:], lens.tolist()[1:], strict=True)])
    with pytest.raises(RuntimeError, match="one context length per token"):
        step(head_weight, lens=[1, 9])
    with pytest.raises(RuntimeError, match="final_norm must be"):
        step(head_weight, final_norm=torch.ones(3))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16, torch.int8], ids=["fp32", "bf16", "int8"])
def test_decode_model_step_of_few_rows_matches_the_per_layer_kernel(kernels, weight_dtype: torch.dtype,
                                                                     family: str) -> None:
    """A decode step of 1 or 3 rows (one-row tiles, each panel its own; the step requests each
    member's next weights and each layer's K and V rows ahead): the same floats as one
    decode_layer call per layer, on every ISA path and team size. Each layer's new K and V rows
    bit-equal (a wrong float in a layer's output moves the next layer's), the logits those of
    the final norm and head; contexts of one to four blocks. Gemma 3's recipe besides Llama's:
    q/k norms, output norms (added by the member that ends the product), GeGLU, two RoPE tables
    read by layer, and the embedding scaled in its dtype (bfloat16 with bfloat16 weights)."""
    bs, num_blocks, vocab, max_positions = 4, 16, 40, 20
    is_gemma = family == "gemma3"
    layers = []
    for i, window in enumerate((None, 5, None)):
        torch.manual_seed(20 + i)
        rope_index = i % 2 if is_gemma else 0
        cfg, layer, fused = _layer_case(weight_dtype, window, kernels, kernels.best_isa(), family, rope_index)
        layers.append(fused)
    gen = torch.Generator().manual_seed(8)
    embed_dtype = torch.bfloat16 if is_gemma and weight_dtype == torch.bfloat16 else torch.float32
    embedding = torch.randn(vocab, cfg.hidden_size, generator=gen).to(embed_dtype)
    embed_scale = torch.tensor(cfg.hidden_size**0.5, dtype=embed_dtype) if is_gemma else None
    rope_tables = []  # per rope: cos, sin [max_positions, D / 2], as the model keeps them
    for speed in (1.0, 0.25)[: 2 if is_gemma else 1]:
        freqs = torch.arange(max_positions).float().unsqueeze(1) * torch.linspace(speed, 0.01, cfg.head_dim // 2)
        rope_tables.append((freqs.cos(), freqs.sin()))
    final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    final_norm.weight.copy_(torch.rand(cfg.hidden_size, generator=gen) + 0.5)
    head = PackedWeight.pack(torch.randn(vocab, cfg.hidden_size, generator=gen), None, torch.float32)
    caches = [(torch.randn(num_blocks * bs, cfg.num_kv_heads, cfg.head_dim, generator=gen),
               torch.randn(num_blocks * bs, cfg.num_kv_heads, cfg.head_dim, generator=gen)) for _ in layers]
    weights = [layer.weights for layer in layers]
    act = layers[0].act
    num_threads = torch.get_num_threads()
    for isa, threads, lens in [(isa, t, lens) for isa in _isas(kernels) for t in (2, 1, 3)
                               for lens in ([11], [3, 16, 1])]:
        batch = len(lens)
        tables = torch.randperm(num_blocks, generator=gen)[: batch * 4].view(batch, 4)
        positions = torch.tensor(lens) - 1
        slots = tables[torch.arange(batch), positions // bs] * bs + positions % bs
        token_ids = torch.randint(0, vocab, (batch,), generator=gen)
        attn = AttentionMetadata(slot_mapping=slots, block_size=bs, block_tables=tables,
                                 context_lens=torch.tensor(lens), backend=CpuAttention(kernels, 0, prefill_in_cpp=False))
        torch.set_num_threads(threads)
        try:
            hidden = embedding[token_ids] if embed_scale is None else embedding[token_ids] * embed_scale
            hidden = hidden.float()
            ref_caches = [(k.clone(), v.clone()) for k, v in caches]
            for layer, (k, v) in zip(layers, ref_caches, strict=True):
                cos, sin = (t[positions].repeat(1, 2) for t in rope_tables[layer.rope_index])  # [M, D]
                layer.forward(hidden, cos, sin, attn, k, v, kernels, isa)
            stepped = [(k.clone(), v.clone()) for k, v in caches]
            decoder = kernels.DecodeModel(embedding, [cos for cos, _ in rope_tables], [sin for _, sin in rope_tables], weights,
                                          stepped, final_norm.weight, head.as_args(), cfg.num_heads, bs,
                                          cfg.rms_norm_eps, cfg.attn_scale, act, embed_scale, isa, [0] * len(weights))
            logits, _ = decoder.step(token_ids.tolist(), [[t[: (n - 1) // bs + 1] for t, n in zip(
                tables.tolist(), lens, strict=True)]], lens, False)
        finally:
            torch.set_num_threads(num_threads)
        case = (ISA_NAMES[isa], threads, batch)
        assert [[torch.equal(a, b) for a, b in zip(kv, kv_ref, strict=True)] for kv, kv_ref in zip(
            stepped, ref_caches, strict=True)] == [[True, True]] * len(layers), case
        assert torch.allclose(logits, kernels.packed_linear(final_norm(hidden), *head.as_args(), isa), atol=1e-4), case


@pytest.mark.parametrize("family", list(LAYER_FAMILIES))
@pytest.mark.parametrize("window", [None, 5], ids=["full", "window5"])
def test_fused_layer_with_prefill_rows_matches_the_torch_layer(kernels, window: int | None, family: str) -> None:
    """A mixed step in the two-call form: a 5-token chunk after 6 cached tokens (flash attention
    over cache and chunk), a whole 3-token prompt, then 2 decode rows (the paged C++ kernel)."""
    from engine.execution.attention import PrefillSeqMeta

    bs, num_blocks = 4, 24
    tables = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(4))[:16].view(4, 4)
    chunk_pos, prompt_pos = torch.arange(6, 11), torch.arange(3)
    decode_lens = torch.tensor([7, 13])
    slots_of = lambda table, pos: table[pos // bs] * bs + pos % bs  # noqa: E731
    slots = torch.cat([slots_of(tables[0], chunk_pos), slots_of(tables[1], prompt_pos),
                       slots_of(tables[2], decode_lens[:1] - 1), slots_of(tables[3], decode_lens[1:] - 1)])
    positions = torch.cat([chunk_pos, prompt_pos, decode_lens - 1])
    metas = [PrefillSeqMeta(0, 5, 11, slots_of(tables[0], torch.arange(11))), PrefillSeqMeta(5, 3, 3, None)]
    for isa in _isas(kernels):
        cfg, layer, fused = _layer_case(torch.float32, window, kernels, isa, family)
        gen = torch.Generator().manual_seed(5)
        k_cache = torch.randn(num_blocks * bs, cfg.num_kv_heads, cfg.head_dim, generator=gen)
        v_cache = torch.randn(num_blocks * bs, cfg.num_kv_heads, cfg.head_dim, generator=gen)
        x = torch.randn(len(positions), cfg.hidden_size, generator=gen)
        freqs = positions.float().unsqueeze(1) * torch.linspace(1, 0.01, cfg.head_dim // 2).unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos, sin = emb.cos(), emb.sin()
        attn = AttentionMetadata(slot_mapping=slots, num_prefill_tokens=8, prefill=metas, block_size=bs,
                                 block_tables=tables[2:], context_lens=decode_lens, backend=CpuAttention(kernels, 0, prefill_in_cpp=False))
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        k_rows, v_rows = k_cache.clone(), v_cache.clone()
        expected = _torch_layer(layer, x, cos.unsqueeze(1), sin.unsqueeze(1), attn, k_ref, v_ref)
        with torch.inference_mode():
            out = x.clone()
            fused.forward(out, cos, sin, attn, k_cache, v_cache, kernels, isa)
            # the rows read after a last layer (each chunk's last, the decode rows): the same
            # values for them, every other row left as it came, the caches written alike
            rows = torch.tensor([4, 7, 8, 9])
            out_rows = x.clone()
            k_torch, v_torch = k_rows.clone(), v_rows.clone()
            fused.forward(out_rows, cos, sin, attn, k_rows, v_rows, kernels, isa, rows)
        expected_rows = _torch_layer(layer, x, cos.unsqueeze(1), sin.unsqueeze(1), attn, k_torch, v_torch, rows)
        assert torch.allclose(out, expected, atol=1e-4), f"{ISA_NAMES[isa]}: {(out - expected).abs().max()}"
        assert torch.allclose(k_cache, k_ref, atol=1e-5) and torch.allclose(v_cache, v_ref, atol=1e-5)
        torch.testing.assert_close(out_rows[rows], expected[rows], atol=1e-4, rtol=0)
        torch.testing.assert_close(expected_rows, expected[rows], atol=1e-5, rtol=0)
        others = torch.ones(len(x), dtype=torch.bool)
        others[rows] = False
        assert torch.equal(out_rows[others], x[others])
        assert torch.equal(k_rows[slots], k_cache[slots]) and torch.equal(v_rows[slots], v_cache[slots])


def test_bf16_fused_layer_over_a_600_token_prompt_matches_the_torch_layer(kernels) -> None:
    """A whole 600-token prompt through a bf16 fused layer on 2 threads: on AMX its gated MLP runs
    on the tiles in tasks of two 32-row blocks a panel (amx_split), each block's activation finished
    between the next block's tile steps, within a panel and across panels. A dropped or misplaced
    row of the activation would be off by that row's update."""
    from engine.execution.attention import PrefillSeqMeta

    isas = [i for i in _isas(kernels) if i >= BF16_PRODUCTS]
    if not isas:
        pytest.skip("this CPU has no bf16 products (AVX512-BF16 or AMX)")
    bs, num_blocks, num_tokens = 16, 40, 600
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(6))[:38]
    positions = torch.arange(num_tokens)
    slots = table[positions // bs] * bs + positions % bs
    num_threads = torch.get_num_threads()
    for isa in isas:
        cfg, layer, fused = _layer_case(torch.bfloat16, None, kernels, isa)
        gen = torch.Generator().manual_seed(7)
        k_cache = torch.zeros(num_blocks * bs, cfg.num_kv_heads, cfg.head_dim)
        v_cache = torch.zeros(num_blocks * bs, cfg.num_kv_heads, cfg.head_dim)
        x = torch.randn(num_tokens, cfg.hidden_size, generator=gen)
        freqs = positions.float().unsqueeze(1) * torch.linspace(1, 0.01, cfg.head_dim // 2).unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos, sin = emb.cos(), emb.sin()
        attn = AttentionMetadata(slot_mapping=slots, num_prefill_tokens=num_tokens,
                                 prefill=[PrefillSeqMeta(0, num_tokens, num_tokens, None)], block_size=bs,
                                 backend=CpuAttention(kernels, 0, prefill_in_cpp=False))
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        expected = _torch_layer(layer, x, cos.unsqueeze(1), sin.unsqueeze(1), attn, k_ref, v_ref)
        with torch.inference_mode():
            out = x.clone()
            torch.set_num_threads(2)
            try:
                fused.forward(out, cos, sin, attn, k_cache, v_cache, kernels, isa)
            finally:
                torch.set_num_threads(num_threads)
        # bf16 products round the activations to bf16: up to about 1 % of the largest output here,
        # and a few % of a row's own update (attention + MLP); a dropped or misplaced row of the
        # MLP's activation would be off by that row's update.
        err, update = (out - expected).abs().amax(dim=1), (expected - x).abs().amax(dim=1)
        assert (err <= 2e-2 * expected.abs().max()).all(), f"{ISA_NAMES[isa]}: {err.max()} of {expected.abs().max()}"
        assert (err <= 0.1 * update).all(), f"{ISA_NAMES[isa]}: rows {(err > 0.1 * update).nonzero().flatten()}"


def test_fused_tokens_defaults_to_the_measured_crossover(tiny_model_dir) -> None:
    """Unset: every step with int8 weights (their only copy), in float32 with AVX-512 and in
    bfloat16 with vdpbf16ps or AMX, and then without oneDNN's second copy of the weights; 64
    tokens in float32 on AVX2 and 8 in bfloat16 on the FMA units (past that, oneDNN's GEMM wins);
    0 turns the path off."""
    from engine import LLM

    def runner(**options):
        return LLM(str(tiny_model_dir), num_kv_blocks=64, max_num_seqs=40, **options).engine.runner

    def fused(**options) -> int:
        return runner(**options).backend.max_fused_tokens

    isa = runner().backend.isa
    assert fused() == (sys.maxsize if isa >= 2 else 64)
    assert fused(dtype="bfloat16") == (sys.maxsize if isa >= BF16_PRODUCTS else 8)
    if isa >= 2:  # every step fused: the projections keep no oneDNN copy
        assert all(m.packed_weight is None for m in runner().model.modules() if hasattr(m, "packed_weight"))
    assert runner(max_fused_tokens=64).model.layers[0].qkv_proj.packed_weight is not None
    assert fused(quantization="int8") == sys.maxsize
    # the startup line says so in words, not as sys.maxsize
    assert runner(quantization="int8").backend.describe().endswith(", every step fused")
    assert runner(max_fused_tokens=64).backend.describe().endswith(", fused steps up to 64 tokens")
    assert fused(max_fused_tokens=0) == 0
    with pytest.raises(ValueError, match="max_fused_tokens"):
        fused(max_fused_tokens=-1)
    with pytest.raises(ValueError, match="quantization"):
        fused(quantization="int4")


def test_int8_without_the_kernels_is_refused_not_slow(tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine import LLM

    monkeypatch.setenv("MINIVLLM_DISABLE_CPP_KERNELS", "1")
    with pytest.raises(ValueError, match="int8 needs the C\\+\\+ CPU kernels"):
        LLM(str(tiny_model_dir), num_kv_blocks=64, quantization="int8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_tied_embedding_is_read_from_the_heads_panels(kernels, dtype: torch.dtype) -> None:
    """The LM head's panels hold the embedding's values: rows gathered from them (torch's path and
    the C++ decode step's) equal the matrix's rows, so the matrix need not be kept twice. Odd
    sizes: 37 rows (a partial last panel), 33 columns (bf16 pairs padded)."""
    from engine.execution.backends.cpu_linear import PanelEmbedding

    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(37, 33, generator=gen).to(dtype)
    head = PackedLinear(torch.nn.Linear(33, 37, bias=False, dtype=dtype))
    head.weight.data.copy_(weight)
    head.pack_panels(dtype, kernels, kernels.best_isa(), max_panel_rows=8)
    ids = torch.tensor([0, 15, 16, 36, 7, 36])
    rows = PanelEmbedding(head, dtype)(ids)
    assert rows.dtype == dtype and torch.equal(rows, weight[ids])


def test_decode_model_reads_each_layers_kv_cache_group_tables(kernels) -> None:
    """DecodeModel.step with KV-cache groups (engine/execution/kv_cache_layout.py): layer 1 in a
    group of its own, its blocks renumbered (block b of group 0 is block
    perm[b] of group 1) and its cache moved to match: the same logits and the same new K/V rows
    as one group; handed group 0's tables instead, it reads other rows and the logits differ."""
    bs, num_blocks, vocab = 4, 40, 70
    lens = [1, 9, 14, 3, 7]
    isa = kernels.best_isa()
    cfg, layers = _three_fused_layers(kernels, isa)
    gen = torch.Generator().manual_seed(7)
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * 4].view(len(lens), 4).tolist()
    tables = [t[: (n - 1) // bs + 1] for t, n in zip(tables, lens, strict=True)]
    caches = [(torch.randn(num_blocks * bs, cfg.num_kv_heads, cfg.head_dim, generator=gen),
               torch.randn(num_blocks * bs, cfg.num_kv_heads, cfg.head_dim, generator=gen)) for _ in layers]
    perm = torch.randperm(num_blocks, generator=gen)
    # slot s of block b in group 0 is slot perm[b] * bs + s % bs in group 1
    slot_of = (perm[:, None] * bs + torch.arange(bs)).reshape(-1)
    moved = [(k.clone(), v.clone()) for k, v in caches]
    moved[1] = tuple(torch.empty_like(c).index_copy_(0, slot_of, c) for c in caches[1])
    group1 = [[int(perm[b]) for b in t] for t in tables]
    embedding = torch.randn(vocab, cfg.hidden_size, generator=gen)
    freqs = torch.arange(20).float().unsqueeze(1) * torch.linspace(1, 0.01, cfg.head_dim // 2)
    cos_table, sin_table = freqs.cos(), freqs.sin()  # [20, D / 2]
    final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    head = PackedWeight.pack(torch.randn(vocab, cfg.hidden_size, generator=gen), None, torch.float32)
    token_ids = [5, 69, 0, 12, 33]

    def step(step_caches, layer_groups, block_tables):
        decoder = kernels.DecodeModel(embedding, [cos_table], [sin_table], [layer.weights for layer in layers],
                                      step_caches, final_norm.weight, head.as_args(), cfg.num_heads, bs,
                                      cfg.rms_norm_eps, cfg.head_dim**-0.5, layers[0].act, None, isa, layer_groups)
        num_threads = torch.get_num_threads()
        torch.set_num_threads(1)  # one thread each: the same floats in the same order
        try:
            return decoder.step(token_ids, block_tables, lens, False)[0]
        finally:
            torch.set_num_threads(num_threads)

    one = [(k.clone(), v.clone()) for k, v in caches]
    expected = step(one, [0, 0, 0], [tables])
    two = [(k.clone(), v.clone()) for k, v in moved]
    assert torch.equal(step(two, [0, 1, 0], [tables, group1]), expected)
    for i in (0, 2):  # the group-0 layers wrote where one group writes
        assert torch.equal(two[i][0], one[i][0]) and torch.equal(two[i][1], one[i][1])
    for got, want in zip(two[1], one[1], strict=True):  # layer 1 wrote its new rows at group 1's slots
        assert torch.equal(got, torch.empty_like(want).index_copy_(0, slot_of, want))
    wrong = [(k.clone(), v.clone()) for k, v in moved]
    assert not torch.allclose(step(wrong, [0, 1, 0], [tables, tables]), expected)
