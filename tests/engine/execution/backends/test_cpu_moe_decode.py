"""A mixture-of-experts model's decode-only steps in one C++ call (kernels.DecodeModel with sparse
layers), on tiny random Qwen3-MoE models (sparse and dense layers alternating, or sparse after a
dense one; the k weights renormalised or not) in float32 and from a GGUF file's Q8_0 blocks, on
AVX-512 and on AVX2:
- every layer's output is the per-layer fused kernels' to the bit (each layer's new K and V rows
  equal, a probe layer after the last one catching its output), on teams of 1 to 3 threads, for
  sequences at different lengths and for a verification's chain of one sequence's rows;
- through the engine, greedy output equals transformers' and every decode step takes the one call
  (batches of sequences at different lengths, speculative verifications), its log-probabilities
  within rounding of the per-layer path's (whose final norm and LM head are torch's);
- the step's experts-touched count is still reported;
- gpt-oss (sinks, router and expert biases, top k then softmax, the clamped SwiGLU) takes it too."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.execution.attention import AttentionMetadata
from engine.execution.backends.cpu_attention import CpuAttention
from tests.helpers import transformers_greedy
from tests.tiny_model import MOE_FAMILIES, build_tiny_family_model, family_config

PROMPTS = [[5, 9, 13], list(range(10, 47)), [42] * 7 + list(range(60, 80)), list(range(100, 300, 7))]
NUM_NEW = 12
ISAS = ["auto", "avx2"]  # the best path this CPU runs (AVX-512 on the CI machines), and AVX2


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def moe_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    path = build_tiny_family_model(tmp_path_factory.mktemp(request.param) / "model", family_config(request.param))
    return path, transformers_greedy(path, PROMPTS, NUM_NEW, attn_implementation="eager")


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list, int]:
    """Every request's (token ids, log-probabilities) and the steps that ran one-call decodes."""
    fused = llm.engine.runner.backend.fused
    fused.take_part_seconds()
    outs = llm.generate(prompts, params)
    return [(o.token_ids, o.logprobs) for o in outs], fused.take_part_seconds()["steps"]


def _one_call_and_per_layer(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list, list]:
    """The same requests through the one-call decode step, then (max_decode_rows 0) through the
    fused layers one call per layer, each path checked to have run its decodes."""
    backend = llm.engine.runner.backend
    assert backend.max_decode_rows == backend.max_fused_tokens > 0  # MoE models take the one-call step
    one_call, steps = _generate(llm, prompts, params)
    assert steps >= NUM_NEW - 1  # every decode step took decode_logits
    backend.max_decode_rows = 0
    try:
        per_layer, steps = _generate(llm, prompts, params)
    finally:
        backend.max_decode_rows = backend.max_fused_tokens
    assert steps == 0
    return one_call, per_layer


@pytest.mark.parametrize("isa", ISAS)
def test_float32_decode_steps_equal_the_per_layer_kernels_and_transformers(moe_model: tuple[Path, list],
                                                                          isa: str) -> None:
    path, reference = moe_model
    llm = LLM(str(path), num_kv_blocks=256, block_size=4, max_num_batched_tokens=512, max_fused_tokens=16,
              kernel_isa=isa)
    for threads in (1, 2, 3):
        _layers_bit_for_bit(llm, threads)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=3)
    one_call, per_layer = _one_call_and_per_layer(llm, PROMPTS, params)  # 4 sequences of 3 to 37 tokens a step
    assert [tokens for tokens, _ in one_call] == reference
    _assert_close(one_call, per_layer)


def _assert_close(one_call: list, per_layer: list) -> None:
    """The same tokens, and log-probabilities within rounding: the layers' floats are the same
    (test_every_layer_is_the_per_layer_kernels_to_the_bit), the final norm and LM head not (torch's
    on the per-layer path, as for dense models)."""
    for (tokens, logprobs), (tokens_ref, logprobs_ref) in zip(one_call, per_layer, strict=True):
        assert tokens == tokens_ref
        for step, step_ref in zip(logprobs, logprobs_ref, strict=True):
            assert step.keys() == step_ref.keys()
            assert all(abs(step[t] - step_ref[t]) < 1e-4 for t in step)


def test_a_speculative_verification_runs_as_a_chain_of_decode_rows(moe_model: tuple[Path, list]) -> None:
    """ngram drafts of a repetitive prompt: each verification is one sequence's rows at consecutive
    positions in one one-call step; the greedy output stays transformers'."""
    path, _ = moe_model
    prompt, num_new = [7, 8, 9, 10, 11] * 6, 40  # both models' answers end in repeats the drafts predict
    reference = transformers_greedy(path, [prompt], num_new, attn_implementation="eager")[0]
    llm = LLM(str(path), num_kv_blocks=256, block_size=4, max_fused_tokens=16, speculative_method="ngram",
              num_speculative_tokens=3)
    engine = llm.engine
    fused = engine.runner.backend.fused
    fused.take_part_seconds()
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=num_new, ignore_eos=True))
    tokens, num_drafts, num_steps = [], 0, 0
    while engine.has_unfinished_requests():
        outputs, stats = engine.step()
        num_drafts += stats.num_draft_tokens
        num_steps += 1
        for out in outputs:
            tokens = out.token_ids
    assert tokens == reference
    assert num_drafts > 0 and num_steps < num_new  # drafts were verified, and some accepted
    assert fused.take_part_seconds()["steps"] == num_steps - 1  # every step after the prefill in one call


def test_a_decode_steps_experts_are_counted(moe_model: tuple[Path, list]) -> None:
    """The one-call step sets each sparse layer's experts-touched count, as the per-layer call does:
    a batch of two at decode touches k to 2 k experts in each sparse layer, the same number either way."""
    path, _ = moe_model
    llm = LLM(str(path), num_kv_blocks=64, block_size=4, max_fused_tokens=16)
    engine = llm.engine
    counts = []
    for max_decode_rows in (llm.engine.runner.backend.max_decode_rows, 0):
        engine.runner.backend.max_decode_rows = max_decode_rows
        for prompt in PROMPTS[:2]:
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        engine.step()  # both prompts
        _, stats = engine.step()
        assert stats.num_decode_tokens == 2 and stats.num_moe_layers == 2
        counts.append(stats.num_experts_touched)
        while engine.has_unfinished_requests():
            engine.step()
    assert counts[0] == counts[1] and 2 * 2 <= counts[0] <= 2 * 2 * 2


def _layers_bit_for_bit(llm: LLM, threads: int) -> None:
    """One decode step of 6 rows (4 sequences at different lengths, then one sequence's 2 rows at
    consecutive positions: a verification's chain) through DecodeModel.step and through one
    decode_layer call per layer on as many threads: every layer's new K and V rows equal. The
    model gets one more layer, a copy of its first, whose K and V rows follow the last layer's
    output."""
    runner = llm.engine.runner
    backend, model = runner.backend, runner.model
    kernels, isa = backend.kernels, backend.isa
    probe = copy.copy(backend.fused)
    probe.layers = [*probe.layers, probe.layers[0]]
    cfg = model.config
    bs, num_blocks = 4, 32
    lens = [1, 9, 14, 6, 11, 12]  # rows 4 and 5: one sequence's positions 10 and 11
    tables = [[3, 7, 1], [0, 9, 2], [4, 5, 6, 8], [10, 11], [12, 13, 14], [12, 13, 14]]
    token_ids = [5, 69, 300, 12, 33, 47]
    gen = torch.Generator().manual_seed(threads)
    caches = [(torch.randn(num_blocks * bs, cfg.num_kv_heads, cfg.head_dim, generator=gen),
               torch.randn(num_blocks * bs, cfg.num_kv_heads, cfg.head_dim, generator=gen)) for _ in probe.layers]
    ref_caches = [(k.clone(), v.clone()) for k, v in caches]
    positions = torch.tensor(lens) - 1
    block_tables = torch.tensor([t + [0] * (4 - len(t)) for t in tables])
    slots = block_tables[torch.arange(len(lens)), positions // bs] * bs + positions % bs
    attn = AttentionMetadata(slot_mapping=slots, block_size=bs, block_tables=block_tables,
                             context_lens=torch.tensor(lens), backend=CpuAttention(kernels, 0, prefill_in_cpp=False))
    num_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        probe.bind_decode(caches, bs, (0,) * len(probe.layers))
        probe.decoder.step(token_ids, [tables], lens, True)
        x = model.embed(torch.tensor(token_ids)).float().contiguous()
        for layer, (k, v) in zip(probe.layers, ref_caches, strict=True):
            cos, sin = model.rope(positions, layer.rope_index)
            layer.forward(x, cos, sin, attn, k, v, kernels, isa)
    finally:
        torch.set_num_threads(num_threads)
    for i, ((k, v), (k_ref, v_ref)) in enumerate(zip(caches, ref_caches, strict=True)):
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref), f"layer {i}, {threads} threads"
    assert not torch.equal(caches[0][0], torch.zeros_like(caches[0][0]))


@pytest.mark.parametrize("isa", ISAS)
def test_gguf_blocks_decode_steps_equal_the_per_layer_kernels(isa: str) -> None:
    """A Qwen3-MoE GGUF file in Q8_0 (llama.cpp's converter: every layer sparse, the experts' panels
    in blocks and their inputs quantized per 32 k)."""
    from tests.field_gguf import field_gguf

    llm = LLM(str(field_gguf("qwen3moe", "q8_0")[0]), num_kv_blocks=256, block_size=4, max_fused_tokens=16,
              kernel_isa=isa)
    assert llm.engine.runner.backend.gguf
    for threads in (1, 2, 3):
        _layers_bit_for_bit(llm, threads)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=3)
    _assert_close(*_one_call_and_per_layer(llm, PROMPTS, params))


def test_gpt_oss_decode_steps_take_the_one_call(tmp_path: Path) -> None:
    """gpt-oss (attention sinks, a router bias, top k then softmax, expert biases, the clamped
    SwiGLU, window and full layers): every layer the per-layer kernels' to the bit, and greedy
    output transformers' with every decode step in one call."""
    path = build_tiny_family_model(tmp_path / "model", family_config("gpt-oss"))
    reference = transformers_greedy(path, PROMPTS, NUM_NEW, attn_implementation="eager")
    llm = LLM(str(path), num_kv_blocks=256, block_size=4, max_fused_tokens=16)
    for threads in (1, 2):
        _layers_bit_for_bit(llm, threads)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    outs, steps = _generate(llm, PROMPTS, params)
    assert [tokens for tokens, _ in outs] == reference
    assert steps >= NUM_NEW - 1
