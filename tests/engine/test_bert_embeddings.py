"""BERT embedders in the engine: bidirectional attention over whole prompts, batched in one step.

Tiny random BertModels saved by sentence-transformers (tests/tiny_bert.py: CLS pooling with
Normalize, mean pooling without; an XLM-RoBERTa with mean pooling) are the reference: the engine's vectors equal its encode() for
prompts of different lengths run together. An encoder's prompt is never split over steps (the
scheduler's can_chunk_prefill), never starts from the prefix cache, and one longer than a step's
token budget is refused naming the field.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM, FieldError, PoolingParams, SamplingParams
from engine.execution.kernels import ISAS
from engine.processing.pooling_params import PoolerConfig, PoolingType
from tests.helpers import cosines
from tests.tiny_bert import build_tiny_bert_embedder

TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog. " * 2, "a",
         "What is the capital of France? Paris is.", "Numbers: 0 1 2 3"]
# pooling mode, Normalize module, family
VARIANTS = {"cls": ("cls", True, "bert"), "mean": ("mean", False, "bert"), "xlm-roberta": ("mean", True, "xlm-roberta")}


@pytest.fixture(scope="module")
def bert_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bert-embedders")
    return {name: build_tiny_bert_embedder(root / name, pooling_mode=mode, normalize=normalize, family=family)
            for name, (mode, normalize, family) in VARIANTS.items()}


def _encode(model_dir: Path, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_dir), device="cpu").encode(texts)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_one_step_of_prompts_equals_sentence_transformers(bert_dirs: dict[str, Path], variant: str) -> None:
    """Every prompt, of five different lengths, in one step: equal to encode(), normalised as the
    model's modules say; nothing held after."""
    model_dir = bert_dirs[variant]
    mode, normalize, _ = VARIANTS[variant]
    expected = _encode(model_dir, TEXTS)
    llm = LLM(str(model_dir), block_size=4, max_num_batched_tokens=128)
    engine = llm.engine
    assert engine.task == "embed" and not engine.is_causal and not engine.can_generate
    assert engine.max_model_len == 128  # XLM-R's table holds 130 positions, its first at 2
    assert engine.pooler_config == PoolerConfig(PoolingType(mode), normalize)
    prompts = [llm.tokenizer.encode(t) for t in TEXTS]
    assert len({len(p) for p in prompts}) == len(TEXTS) and sum(map(len, prompts)) <= 128
    assert all(p[0] == llm.tokenizer.cls_token_id and p[-1] == llm.tokenizer.sep_token_id for p in prompts)
    free_before = engine.block_manager.num_free_blocks
    request_ids = [engine.add_request(t, PoolingParams()) for t in TEXTS]
    outputs, stats = engine.step()
    assert stats.num_prefill_seqs == len(TEXTS) and stats.num_prefill_tokens == sum(map(len, prompts))
    by_id = {o.request_id: o for o in outputs}
    assert all(by_id[r].is_finished and by_id[r].finish_reason == "stop" for r in request_ids)
    got = np.array([by_id[r].embedding for r in request_ids])
    assert got.shape == expected.shape
    assert cosines(got, expected).min() >= 0.9999
    norms = np.linalg.norm(got, axis=-1)
    if normalize:
        np.testing.assert_allclose(norms, 1.0, atol=1e-5)
    else:
        np.testing.assert_allclose(norms, np.linalg.norm(expected, axis=-1), rtol=1e-4)
        assert norms.min() > 1.5
    assert engine.block_manager.num_free_blocks == free_before and not engine.has_unfinished_requests()
    # alone, each prompt pools the same (nothing of another prompt leaks into its attention)
    alone = np.array([llm.embed([t])[0].embedding for t in TEXTS[:2]])
    assert cosines(alone, got[:2]).min() >= 0.99999


def test_prompts_are_never_split_over_steps(bert_dirs: dict[str, Path]) -> None:
    """A token budget smaller than the prompts together: each prompt runs whole in the one step
    that takes it (one that does not fit what is left waits for the next), every vector equal to
    encode()'s; a prompt over the budget is refused, naming the field and the limit."""
    model_dir = bert_dirs["cls"]
    llm = LLM(str(model_dir), block_size=4, max_num_batched_tokens=24)
    engine = llm.engine
    lengths = {t: len(llm.tokenizer.encode(t)) for t in TEXTS[:4]}
    assert max(lengths.values()) <= 24 < sum(lengths.values())
    assert engine.max_model_len == 24
    request_ids = {engine.add_request(t, PoolingParams()): t for t in TEXTS[:4]}
    finals, steps = {}, []
    while engine.has_unfinished_requests():
        outputs, stats = engine.step()
        steps.append(stats.prefill_request_ids)
        assert stats.num_prefill_tokens == sum(lengths[request_ids[r]] for r in stats.prefill_request_ids) <= 24
        finals.update({o.request_id: o for o in outputs if o.is_finished})
    assert len(steps) > 1 and sorted(r for s in steps for r in s) == sorted(request_ids)  # each in one step
    got = np.array([finals[r].embedding for r in request_ids])
    assert cosines(got, _encode(model_dir, list(request_ids.values()))).min() >= 0.9999
    with pytest.raises(FieldError) as err:
        llm.embed([TEXTS[1] * 2])
    assert err.value.field == "prompt" and "max_num_batched_tokens" in str(err.value)
    with pytest.raises(FieldError) as err:
        llm.embed([list(range(5, 30))])  # 25 token ids
    assert err.value.field == "prompt" and "25 tokens" in str(err.value)


def test_time_budget_never_splits_a_prompt_it_cannot_fit() -> None:
    """The scheduler alone: under a step-time target a non-chunkable prompt runs whole when it is
    the step's first (its progress guarantee) and waits whole otherwise, never a part of it."""
    from engine import EngineConfig
    from engine.core.block_manager import BlockManager
    from engine.core.scheduler import Scheduler
    from engine.core.sequence import SequenceStatus
    from tests.helpers import fake_seq

    def scheduler(can_chunk: bool) -> Scheduler:
        config = EngineConfig(max_num_batched_tokens=256, max_step_ms=0.001, min_prefill_share=0.0)
        sched = Scheduler(config, BlockManager(256, 4, enable_prefix_caching=False), can_chunk_prefill=can_chunk)
        decode = fake_seq("d", 6, num_output=1)
        assert sched.block_manager.allocate(decode, 6)
        decode.num_computed_tokens, decode.status = 6, SequenceStatus.RUNNING
        sched.running.append(decode)
        sched.add(fake_seq("p1", 40, arrival=1.0))
        sched.add(fake_seq("p2", 40, arrival=2.0))
        return sched

    chunked = scheduler(True).schedule(now=3.0)
    assert chunked.budget_source == "time" and chunked.prefill_num_tokens[0] < 40  # the prompt was split
    whole = scheduler(False).schedule(now=3.0)
    assert whole.budget_source == "time" and whole.prefill_req_ids == ["p1"] and whole.prefill_num_tokens == [40]


def test_no_prefix_reuse_and_no_generation(bert_dirs: dict[str, Path]) -> None:
    """The same prompt twice computes every token again, whatever the pooling (an encoder keeps
    no K/V); asked to generate, the engine says it cannot."""
    llm = LLM(str(bert_dirs["cls"]), block_size=4)
    assert not llm.engine.block_manager.enable_prefix_caching
    first = llm.embed([TEXTS[1]], PoolingParams(pooling_type="last"))
    again = llm.embed([TEXTS[1]], PoolingParams(pooling_type="last"))
    assert again[0].num_cached_tokens == 0
    assert cosines(np.array([first[0].embedding]), np.array([again[0].embedding])).min() >= 0.99999
    with pytest.raises(ValueError, match="only embed"):
        llm.generate("hello", SamplingParams(max_tokens=2))


def test_bare_bert_directory_pools_at_cls(bert_dirs: dict[str, Path]) -> None:
    """A BertModel directory without sentence-transformers' files (the embedder's source): task
    auto cannot generate with it and says so; --task embed pools at [CLS], normalised."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    bare = bert_dirs["mean"].with_name("mean-hf")
    assert not (bare / "modules.json").exists()
    with pytest.raises(ValueError, match="--task embed"):
        LLM(str(bare), block_size=4)
    llm = LLM(str(bare), block_size=4, task="embed")
    assert llm.engine.pooler_config == PoolerConfig(PoolingType.CLS, normalize=True)
    tokenizer, reference = AutoTokenizer.from_pretrained(str(bare)), AutoModel.from_pretrained(str(bare)).eval()
    with torch.inference_mode():
        expected = np.array([reference(**tokenizer(t, return_tensors="pt")).last_hidden_state[0, 0].numpy()
                             for t in TEXTS])
    got = np.array([o.embedding for o in llm.embed(TEXTS)])
    assert cosines(got, expected).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-5)


def test_bfloat16_encoder_keeps_a_float32_stream(bert_dirs: dict[str, Path]) -> None:
    """dtype bfloat16: every product on the bfloat16 panels. Where those run every step (vdpbf16ps
    or AMX), the embeddings, LayerNorms and residual stream stay float32 (no rounding copy after
    each product, the epilogues fused into it) and attention multiplies in bfloat16; the vectors
    stay within bfloat16's rounding of encode()'s float32 ones either way."""
    model_dir = bert_dirs["cls"]
    expected = _encode(model_dir, TEXTS)
    llm = LLM(str(model_dir), max_num_batched_tokens=128, dtype="bfloat16")
    runner = llm.engine.runner
    backend = runner.backend
    got = np.array([o.embedding for o in llm.embed(TEXTS)])
    assert cosines(got, expected).min() >= 0.999
    is_float_stream = getattr(backend, "kernels", None) is not None and backend.isa >= ISAS["avx512_bf16"]
    layer = runner.model.layers[0]
    assert layer.attn_norm.weight.dtype == (torch.float32 if is_float_stream else torch.bfloat16)
    assert runner.model.position_embeddings.weight.dtype == layer.attn_norm.weight.dtype
    assert runner.model.embed_tokens.weight.dtype == torch.bfloat16  # the large table is not doubled
    if is_float_stream:
        assert layer.qkv_proj.panels.data.dtype == torch.bfloat16 and layer.qkv_proj.weight is None
        assert backend.attention.is_bf16_bidirectional


@pytest.mark.parametrize("options", [{"kernel_isa": "avx512"}, {"max_fused_tokens": 8}], ids=["avx512", "onednn"])
def test_bfloat16_encoder_on_a_bfloat16_stream(bert_dirs: dict[str, Path], options: dict[str, object]) -> None:
    """dtype bfloat16 where the stream stays bfloat16 (AVX-512 without BF16: no bfloat16 panel
    products; or rows past max_fused_tokens on oneDNN): attention hands back bfloat16 rows and the
    projections take them, the vectors within bfloat16's rounding of encode()'s."""
    from engine.execution.kernels import load_cpu_kernels

    kernels = load_cpu_kernels()
    if "kernel_isa" in options and (kernels is None or kernels.best_isa() < ISAS["avx512"]):
        pytest.skip("this CPU has no AVX-512: the avx512 kernel path does not run here")
    model_dir = bert_dirs["cls"]
    llm = LLM(str(model_dir), max_num_batched_tokens=128, dtype="bfloat16", **options)
    got = np.array([o.embedding for o in llm.embed(TEXTS)])
    assert cosines(got, _encode(model_dir, TEXTS)).min() >= 0.999


def test_pooled_rows_alone_through_the_last_layer(bert_dirs: dict[str, Path]) -> None:
    """A step whose prompts all pool one row ([CLS] or last) runs its last layer past attention
    for those rows alone; one with a mean-pooled prompt runs it for every row. Each vector equals
    transformers' states pooled as its request asks, in steps of either kind."""
    from transformers import AutoModel, AutoTokenizer

    model_dir = bert_dirs["mean"]  # a mean-pooling model, unnormalised: requests override its pooling
    tokenizer, reference = AutoTokenizer.from_pretrained(str(model_dir)), AutoModel.from_pretrained(str(model_dir))
    with torch.inference_mode():
        states = [reference(**tokenizer(t, return_tensors="pt")).last_hidden_state[0].numpy() for t in TEXTS]
    pooled = {"cls": [s[0] for s in states], "last": [s[-1] for s in states], "mean": [s.mean(0) for s in states]}
    llm = LLM(str(model_dir), block_size=4, max_num_batched_tokens=128)
    engine, model = llm.engine, llm.engine.runner.model
    seen: list[torch.Tensor | None] = []
    forward = model.forward
    model.forward = lambda *args, **kwargs: (seen.append(kwargs.get("output_rows")), forward(*args, **kwargs))[1]
    prompts = [llm.tokenizer.encode(t) for t in TEXTS]
    starts = np.cumsum([0] + [len(p) for p in prompts])[:-1]
    for kinds in (["cls", "last", "cls", "last", "last"], ["cls", "mean", "last", "cls", "mean"]):
        ids = [engine.add_request(t, PoolingParams(pooling_type=k)) for t, k in zip(TEXTS, kinds, strict=True)]
        outputs, _ = engine.step()
        by_id = {o.request_id: o.embedding for o in outputs}
        got = np.array([by_id[r] for r in ids])
        expected = np.array([pooled[k][i] for i, k in enumerate(kinds)])
        np.testing.assert_allclose(got, expected, atol=2e-5, rtol=1e-4)
    one_row, every_row = seen
    assert every_row is None
    expected_rows = [s + (len(p) - 1 if k == "last" else 0)
                     for s, p, k in zip(starts, prompts, ["cls", "last", "cls", "last", "last"], strict=True)]
    assert one_row.tolist() == expected_rows
