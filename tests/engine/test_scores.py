"""Score requests in the engine: prefill only, the score head on the pooled state, finished with
its logits.

Tiny random rerankers built offline are the reference: a Qwen3ForSequenceClassification's logits
equal transformers' for each pair (prompts chunked over several steps), and a Qwen3 causal LM
served with --task score gives logit("yes") - logit("no") of its last token, whose sigmoid is the
probability Qwen3-Reranker's model card computes. Token types reach a model that reads them,
aligned with the step's packed tokens.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM, FieldError, PoolingParams, SamplingParams
from tests.tiny_model import build_tiny_sequence_classifier

PAIRS = [("hello world", "The quick brown fox jumps over the lazy dog. " * 3),
         ("what is a paged KV cache?", "A paged KV cache stores keys and values in fixed-size blocks."),
         ("a", "b"), ("Unicode: café", "naïve, 你好, 世界")]


@pytest.mark.parametrize("family", ["qwen3", "qwen2-untied"])
def test_sequence_classifier_scores_equal_transformers(classifier_dir: Path, tmp_path: Path, family: str) -> None:
    """task auto is score for a *ForSequenceClassification (Qwen3's, and Qwen2's with q/k/v biases
    and an untied config: no LM head in either checkpoint); each pair's logit equals transformers'
    (its tokenizer's pair encoding, chunked 16 tokens a step), and every block is free after."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if family != "qwen3":
        classifier_dir = build_tiny_sequence_classifier(tmp_path / family, family=family)

    tokenizer = AutoTokenizer.from_pretrained(str(classifier_dir))
    reference = AutoModelForSequenceClassification.from_pretrained(str(classifier_dir), dtype=torch.float32).eval()
    prompts = [tokenizer(query, document)["input_ids"] for query, document in PAIRS]
    with torch.no_grad():
        expected = [reference(torch.tensor([ids])).logits[0].tolist() for ids in prompts]
    llm = LLM(str(classifier_dir), num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    assert llm.engine.task == "score" and not llm.engine.can_generate
    assert max(map(len, prompts)) > 16  # some pairs really are chunked
    free_before = llm.engine.block_manager.num_free_blocks
    outputs = llm.score(prompts)
    got = [o.scores for o in outputs]
    assert all(len(s) == 1 for s in got)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    assert np.ptp(np.array(got)) > 0.05  # the pairs' scores differ: a constant head would not pass
    assert all(o.finish_reason == "stop" and o.token_ids == [] and o.embedding is None for o in outputs)
    assert all(o.metrics.task == "score" for o in outputs)
    assert llm.engine.block_manager.num_free_blocks == free_before
    with pytest.raises(ValueError, match="cannot generate, only score"):
        llm.generate("hello", SamplingParams(max_tokens=2))


def test_label_token_reranker_equals_its_model_card(reranker_lm_dir: Path) -> None:
    """A causal LM served with --task score (label tokens no, yes by default): its score is the
    last token's logit("yes") - logit("no"), and its sigmoid the card's softmax over [no, yes]."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(reranker_lm_dir))
    reference = AutoModelForCausalLM.from_pretrained(str(reranker_lm_dir), dtype=torch.float32).eval()
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    prompts = [tokenizer(f"<Query>: {query}\n<Document>: {document}")["input_ids"] for query, document in PAIRS]
    with torch.no_grad():
        last = [reference(torch.tensor([ids])).logits[0, -1] for ids in prompts]
    card = [torch.log_softmax(torch.stack([row[no], row[yes]]), dim=0).exp()[1].item() for row in last]
    llm = LLM(str(reranker_lm_dir), task="score", num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    assert llm.engine.model_info().score_label_tokens == ("no", "yes")
    got = np.array([o.scores for o in llm.score(prompts)])  # [pairs, 1]
    np.testing.assert_allclose(got[:, 0], [(row[yes] - row[no]).item() for row in last], atol=1e-4, rtol=0)
    np.testing.assert_allclose(1 / (1 + np.exp(-got[:, 0])), card, atol=1e-5, rtol=0)
    assert np.ptp(card) > 0.01
    # one label token: its own logit
    single = LLM(str(reranker_lm_dir), task="score", score_label_tokens="yes", num_kv_blocks=64, block_size=4)
    np.testing.assert_allclose([o.scores[0] for o in single.score(prompts)], [row[yes].item() for row in last],
                               atol=1e-4, rtol=0)


def test_scores_beside_decoding_streams(reranker_lm_dir: Path) -> None:
    """Score requests batched in the steps of decoding streams (the same model generates and
    scores): the streams' tokens and the scores are those each gives alone."""
    llm = LLM(str(reranker_lm_dir), task="score", num_kv_blocks=128, block_size=4, max_num_batched_tokens=24)
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["Once upon a time", "def main():"]
    alone = [o.token_ids for o in llm.generate(prompts, greedy)]
    texts = [f"{q} {d}" for q, d in PAIRS]
    scores_alone = [o.scores for o in llm.score(texts)]
    stream_ids = [engine.add_request(p, greedy) for p in prompts]
    score_ids, finals, step = [], {}, 0
    while engine.has_unfinished_requests():
        step += 1
        if 2 <= step < 2 + len(texts):
            score_ids.append(engine.add_request(texts[step - 2], PoolingParams(task="score")))
        for out in engine.step()[0]:
            if out.is_finished:
                finals[out.request_id] = out
    assert [finals[r].token_ids for r in stream_ids] == alone
    np.testing.assert_allclose([finals[r].scores for r in score_ids], scores_alone, atol=1e-5, rtol=0)


def test_token_types_reach_a_model_that_reads_them(classifier_dir: Path) -> None:
    """A model with uses_token_types gets token_type_ids= aligned with the step's packed input ids
    (each prompt's slice for its chunk, 0 elsewhere; None when no request has any); the types are
    checked against the prompt's length."""
    llm = LLM(str(classifier_dir), num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    engine, runner = llm.engine, llm.engine.runner
    # The Qwen3 classifier reads no token types: pretend it does, recording what its forward gets.
    engine.uses_token_types = runner.uses_token_types = True
    seen: list[tuple[list[int], list[int] | None]] = []
    forward = runner.backend.forward

    def recording_forward(model, input_ids, positions, attn, kv_caches, **model_inputs):
        types = model_inputs.pop("token_type_ids")
        seen.append((input_ids.tolist(), None if types is None else types.tolist()))
        return forward(model, input_ids, positions, attn, kv_caches, **model_inputs)

    runner.backend.forward = recording_forward
    first = list(range(3, 15)) + list(range(40, 53))  # 25 tokens: two chunks of the 16-token budget
    second = list(range(60, 70))
    types = {tuple(first): [0] * 12 + [1] * 13, tuple(second): [1] * 4 + [0] * 6}
    for prompt in (first, second):
        request = engine.process_inputs(PoolingParams(task="score"), prompt, token_type_ids=types[tuple(prompt)])
        engine.admit(request)
    engine.admit(engine.process_inputs(PoolingParams(task="score"), list(range(80, 85))))  # no types
    while engine.has_unfinished_requests():
        engine.step()
    packed_ids = [t for ids, _ in seen for t in ids]
    packed_types = [t for ids, step_types in seen for t in (step_types or [0] * len(ids))]
    assert sorted(packed_ids) == sorted(first + second + list(range(80, 85)))
    by_token = dict(zip(packed_ids, packed_types, strict=True))  # the prompts' ids are distinct
    assert [by_token[t] for t in first] == types[tuple(first)]
    assert [by_token[t] for t in second] == types[tuple(second)]
    assert all(by_token[t] == 0 for t in range(80, 85))
    engine.admit(engine.process_inputs(PoolingParams(task="score"), list(range(90, 95))))
    while engine.has_unfinished_requests():
        engine.step()
    assert seen[-1] == (list(range(90, 95)), None)  # a step without typed prompts: None
    with pytest.raises(FieldError) as err:
        engine.process_inputs(PoolingParams(task="score"), [5, 6, 7], token_type_ids=[0, 1])
    assert err.value.field == "token_type_ids"
    with pytest.raises(FieldError) as err:
        engine.process_inputs(PoolingParams(task="score"), [5, 6, 7], token_type_ids=[0, -1, 0])
    assert err.value.field == "token_type_ids[1]"


def test_decoder_models_never_see_token_types(classifier_dir: Path) -> None:
    """A model without uses_token_types: the request's types are dropped at admission and its
    forward gets no token types, only the rows read after it (the fused path stays open)."""
    llm = LLM(str(classifier_dir), num_kv_blocks=64, block_size=4)
    request = llm.engine.process_inputs(PoolingParams(task="score"), [5, 6, 7], token_type_ids=[0, 1, 1])
    assert request.token_type_ids is None
    calls = []
    forward = llm.engine.runner.backend.forward

    def recording_forward(*args, **model_inputs):
        calls.append(model_inputs)
        return forward(*args, **model_inputs)

    llm.engine.runner.backend.forward = recording_forward
    llm.engine.admit(request)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert len(calls) == 1 and calls[0].keys() == {"output_rows"}
    assert calls[0]["output_rows"].tolist() == [2]  # the score head reads the last token's state


def test_bad_score_requests_and_options(classifier_dir: Path, reranker_lm_dir: Path, tiny_llm: LLM,
                                        tmp_path: Path) -> None:
    with pytest.raises(FieldError) as err:
        PoolingParams(task="rank")
    assert err.value.field == "task"
    llm = LLM(str(classifier_dir), num_kv_blocks=64, block_size=4)
    for field, value in (("dimensions", 8), ("normalize", True), ("pooling_type", "mean")):
        with pytest.raises(FieldError) as err:
            llm.engine.process_inputs(PoolingParams(task="score", **{field: value}), "hello")
        assert err.value.field == field
    with pytest.raises(FieldError) as err:  # a plain causal LM served for generation has no score head
        tiny_llm.score("hello")
    assert err.value.field == "task"
    with pytest.raises(ValueError, match="score_label_tokens"):
        LLM(str(reranker_lm_dir), task="score", score_label_tokens="maybe", num_kv_blocks=16)
    with pytest.raises(ValueError, match="score_label_tokens"):
        LLM(str(classifier_dir), score_label_tokens="no,yes", num_kv_blocks=16)
    with pytest.raises(ValueError, match="score_label_tokens"):
        LLM(str(reranker_lm_dir), task="score", score_label_tokens="a,b,c", num_kv_blocks=16)
    two_labels = build_tiny_sequence_classifier(tmp_path / "two-labels", num_labels=2)
    with pytest.raises(ValueError, match="2 labels"):
        LLM(str(two_labels), num_kv_blocks=16)
