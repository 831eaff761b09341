"""Speculative decoding: the proposers, exactness in greedy decoding (every family, whole and
chunked prefill, preemption, n > 1, stop strings, a grammar), the target's distribution kept
when sampling, and no block left behind. Proposals come from an oracle in most tests: the
reference continuation with every third proposal corrupted, so both acceptance and rejection
run on every path (a tiny random model rarely repeats itself for n-grams to find)."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams, StructuredOutput
from engine.execution.sampler import Sampler
from engine.execution.speculative import NgramProposer, SuffixProposer
from engine.execution.speculative.proposer import Proposer
from tests.helpers import run_engine


def test_ngram_proposes_what_followed_the_latest_match_longest_first() -> None:
    proposer = NgramProposer(num_tokens=3, min_n=2, max_n=3)
    tokens = np.array([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3])
    assert proposer.propose(tokens) == [7, 8, 5]  # [1 2 3] last seen before 7 8 5
    assert proposer.propose(np.array([4, 5, 6, 4, 5])) == [6, 4, 5]  # n = 2; the run may reach the suffix itself
    assert proposer.propose(np.array([1, 2, 3, 4])) == []
    assert proposer.propose(np.array([5])) == []


def test_suffix_follows_the_continuation_most_matches_agree_on_and_learns_from_finished_requests() -> None:
    proposer = SuffixProposer(num_tokens=4)
    # The suffix [8 9] occurred three times (no longer suffix did): twice followed by 1 2 3, once
    # by 4: the majority's continuation, for at most as long as the match (2).
    tokens = np.array([8, 9, 1, 2, 3, 5, 8, 9, 1, 2, 3, 6, 8, 9, 4, 7, 8, 9])
    assert proposer.propose(tokens) == [1, 2]
    # A longer match proposes longer: [3 5 8 9] occurred once, followed by 1 2 3 6.
    assert proposer.propose(np.array([2, 3, 5, 8, 9, 1, 2, 3, 6, 2, 3, 5, 8, 9])) == [1, 2, 3, 6]
    assert proposer.propose(np.array([6, 7])) == []
    proposer.observe_finished(np.array([6, 7, 50, 51, 52, 53, 54]))
    assert proposer.propose(np.array([3, 6, 7])) == [50, 51]  # from another request's output
    assert proposer.propose(np.array([5, 53])) == [54]


class OracleProposer(Proposer):
    """Proposes the reference continuation of whichever reference the tokens so far begin, with
    every third proposal replaced by another token (a rejection)."""

    method = "ngram"

    def __init__(self, references: list[list[int]], num_tokens: int, vocab_size: int) -> None:
        self.references, self.num_tokens, self.vocab_size = references, num_tokens, vocab_size
        self.calls = 0

    def propose(self, token_ids: np.ndarray) -> list[int]:
        tokens = token_ids.tolist()
        for ref in self.references:
            if ref[: len(tokens)] == tokens:
                drafts = ref[len(tokens) : len(tokens) + self.num_tokens]
                self.calls += 1
                if self.calls % 3 == 0 and drafts:
                    drafts[len(drafts) // 2] = (drafts[len(drafts) // 2] + 1) % self.vocab_size
                return drafts
        return []


def _generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    ids = [engine.add_request(p, params) for p in prompts]
    outputs, _ = run_engine(engine)
    assert engine.block_manager.num_used_blocks == 0, "blocks left behind"
    return [outputs[i][-1].token_ids for i in ids]


def _with_oracle(engine: LLMEngine, prompts: list[list[int]], reference: list[list[int]]) -> OracleProposer:
    oracle = OracleProposer([p + r for p, r in zip(prompts, reference, strict=True)],
                            engine.config.num_speculative_tokens, engine.vocab_size)
    engine.runner.speculator.proposer = oracle
    return oracle


PROMPTS = [[5, 9, 200, 31, 7, 11, 13], [44] * 23, list(range(3, 40)), [17, 99, 3]]


@pytest.mark.parametrize("budget,num_blocks", [(512, 256), (16, 256), (16, 20)],
                         ids=["whole-prefill", "chunked-prefill", "preemption"])
def test_greedy_with_speculation_is_token_exact(tiny_model_dir: Path, budget: int, num_blocks: int) -> None:
    options = dict(model=str(tiny_model_dir), num_kv_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget,
                   enable_time_budget=False, speculative_max_batch=8)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reference = _generate(LLMEngine(EngineConfig(**options)), PROMPTS, params)
    engine = LLMEngine(EngineConfig(speculative_method="ngram", num_speculative_tokens=4, **options))
    oracle = _with_oracle(engine, PROMPTS, reference)
    preempted = []
    original_step = engine.step

    def step():  # noqa: ANN202 - records what the steps did
        outputs, stats = original_step()
        preempted.append(stats.num_preemptions)
        return outputs, stats

    engine.step = step
    assert _generate(engine, PROMPTS, params) == reference
    assert oracle.calls > 10
    if num_blocks == 20:
        assert sum(preempted) > 0, "the pool is small enough to preempt"


def test_speculation_keeps_n_samples_stops_and_grammars_exact(tiny_model_dir: Path) -> None:
    options = dict(model=str(tiny_model_dir), num_kv_blocks=256, block_size=4, max_num_batched_tokens=32,
                   enable_time_budget=False, speculative_max_batch=8)
    base = LLMEngine(EngineConfig(**options))
    prompt = [5, 9, 200, 31, 7, 11, 13]
    plain = _generate(base, [prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    # A stop token id in the middle of the greedy run: the output ends there with speculation too.
    stop_id = plain[12]
    cases = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, n=3),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, min_tokens=20, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0, max_tokens=40, structured_output=StructuredOutput(
            "json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}))),
    ]
    for params in cases:
        ids = base.add_request(prompt, params)
        outputs, _ = run_engine(base)
        reference = sorted((o.index, o.token_ids) for o in outputs[ids] if o.is_finished)
        engine = LLMEngine(EngineConfig(speculative_method="ngram", num_speculative_tokens=4, **options))
        # The oracle knows sample 0's continuation (every sample of a greedy request is the same).
        _with_oracle(engine, [prompt], [reference[0][1]])
        got_id = engine.add_request(prompt, params)
        got, _ = run_engine(engine)
        assert sorted((o.index, o.token_ids) for o in got[got_id] if o.is_finished) == reference, params
        assert engine.block_manager.num_used_blocks == 0


def test_greedy_on_every_family_with_ngram_proposals(tmp_path: Path) -> None:
    """The proposers themselves on a repetitive prompt, and an oracle's proposals verified, over
    the families' tiny models (sliding windows, tied embeddings, biases)."""
    from tests.test_model_families import FAMILIES, _config
    from tests.tiny_model import build_tiny_family_model

    prompt = [7, 8, 9, 10, 11, 12] * 6
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for family in FAMILIES:
        path = build_tiny_family_model(tmp_path / family, _config(family))
        options = dict(model=str(path), num_kv_blocks=128, block_size=4, max_num_batched_tokens=16,
                       enable_time_budget=False)
        reference = _generate(LLMEngine(EngineConfig(**options)), [prompt], params)
        for method in ("ngram", "suffix", "oracle"):
            # A random model rarely repeats itself, so the real proposers may find nothing to
            # propose here; the oracle's drafts make sure every family verifies (and rejects).
            engine = LLMEngine(EngineConfig(speculative_method="ngram" if method == "oracle" else method, **options))
            if method == "oracle":
                _with_oracle(engine, [prompt], reference)
            rid = engine.add_request(prompt, params)
            final = run_engine(engine)[0][rid][-1]
            assert final.token_ids == reference[0], (family, method)
            if method == "oracle":
                assert 0 < final.metrics.num_accepted_tokens < final.metrics.num_draft_tokens, family


def test_sampling_with_speculation_keeps_the_target_distribution(tiny_model_dir: Path) -> None:
    """Two sampled tokens after the prompt, over many seeds, with and without verification of an
    oracle's proposals (accepted about half the time): their empirical distributions agree
    within sampling error. Skipping the residual's renormalisation (sampling again from p after
    rejecting x) inflates x's probability and fails this."""
    prompt = [5, 9, 200, 31, 7]
    num = 1500
    options = dict(model=str(tiny_model_dir), num_kv_blocks=2048, block_size=4, max_num_seqs=256, max_num_waiting=2000,
                   max_num_batched_tokens=2048, enable_time_budget=False)

    def draws(method: str) -> list[tuple[int, ...]]:
        engine = LLMEngine(EngineConfig(speculative_method=method, speculative_max_batch=256,
                                        num_speculative_tokens=2, **options))
        if method != "none":
            greedy = _generate(LLMEngine(EngineConfig(**options)), [prompt],
                               SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]

            class Likeliest(Proposer):  # the greedy continuation, whatever was sampled
                method = "ngram"

                def propose(self, token_ids: np.ndarray) -> list[int]:
                    return greedy[len(token_ids) - len(prompt) : len(token_ids) - len(prompt) + 2]

            engine.runner.speculator.proposer = Likeliest()
        ids = [engine.add_request(prompt, SamplingParams(temperature=1.0, top_k=3, max_tokens=4, ignore_eos=True,
                                                         seed=1000 * (method != "none") + i)) for i in range(num)]
        outputs, _ = run_engine(engine)
        if method != "none":
            assert sum(o.metrics.num_draft_tokens for i in ids for o in outputs[i] if o.metrics) > num
        return [tuple(outputs[i][-1].token_ids[1:3]) for i in ids]

    plain, speculative = draws("none"), draws("ngram")
    for position in (0, 1):
        a = Counter(t[position] for t in plain)
        b = Counter(t[position] for t in speculative)
        tv = 0.5 * sum(abs(a[k] - b[k]) for k in set(a) | set(b)) / num
        assert tv < 0.06, (position, tv, a.most_common(4), b.most_common(4))


def test_verify_accepts_with_the_target_probability_and_renormalises_the_rest() -> None:
    """The sampler alone: a draft of probability 0.3 is the first token 30 % of the time and
    every other token keeps its own probability; a greedy row accepts exactly the argmax."""
    gen = torch.Generator().manual_seed(0)
    sampler = Sampler(torch.device("cpu"))
    sampler.generator = gen
    probs = torch.tensor([0.3, 0.5, 0.2, 0.0])
    logits = probs.clamp_min(1e-30).log().expand(2, -1)  # [2, 4]: the draft's row and the one after
    view = SamplingParams(temperature=1.0)

    class Row:
        params, prompt_token_ids, output_token_ids, generator, matcher = view, [1], [], None, None
        min_tokens_stop_ids = frozenset()
        num_output_tokens = 0

    counts = Counter()
    num = 20000
    for _ in range(num):
        tokens, _ = sampler.verify(logits.clone(), [Row(), Row()], [(0, [0])])
        counts[tokens[0][0]] += 1
    for token, p in enumerate(probs.tolist()):
        assert abs(counts[token] / num - p) < 0.015, (token, counts)
    greedy = SamplingParams(temperature=0)
    Row.params = greedy
    assert sampler.verify(logits.clone(), [Row(), Row()], [(0, [1])])[0] == [[1, 1]]  # accepted, then the argmax
    assert sampler.verify(logits.clone(), [Row(), Row()], [(0, [0])])[0] == [[1]]  # rejected: the argmax instead


def test_no_block_leaks_under_speculation_cancels_and_preemption(tiny_model_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=24, block_size=4,
                                    max_num_batched_tokens=32, enable_time_budget=False, speculative_method="ngram",
                                    speculative_max_batch=8))
    prompts = [[7, 8, 9, 10] * 4, [3, 4, 5] * 5, [11, 12] * 8, [20, 21, 22, 23, 24] * 3]
    ids = [engine.add_request(p, SamplingParams(temperature=0.7, seed=i, max_tokens=40, ignore_eos=True))
           for i, p in enumerate(prompts)]
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps == 6:
            engine.abort_request(ids[1])
        bm = engine.block_manager
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
        assert bm.count_referenced_blocks() == bm.num_used_blocks
    engine.step()
    assert engine.block_manager.num_used_blocks == 0 and engine.runner.batch.rows == {}


def test_speculation_is_off_past_its_batch_and_by_default(tiny_model_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256, block_size=4,
                                    speculative_method="ngram", speculative_max_batch=2, enable_time_budget=False))
    for i in range(3):
        engine.add_request([7, 8, 9, 10] * 6, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, seed=i))
    verified = []
    while engine.has_unfinished_requests():
        _, stats = engine.step()
        if stats.num_decode_seqs + len(stats.accepted_lengths) > 2:
            verified.append(stats.num_verify_tokens)
    assert verified and not any(verified), "three decoding sequences: past speculative_max_batch, nothing verified"
    with pytest.raises(ValueError, match="speculative_method"):
        EngineConfig(speculative_method="medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative_method="ngram", num_speculative_tokens=0)


def test_speculation_keeps_logprobs_stop_strings_and_seeds(tiny_model_dir: Path) -> None:
    """Accepted tokens carry the target's logprobs (what the run without speculation reports),
    a stop string inside an accepted run ends the text there, a seeded sampled request repeats
    itself run to run, and a step that accepts several tokens delivers them in one output."""
    options = dict(model=str(tiny_model_dir), num_kv_blocks=256, block_size=4, max_num_batched_tokens=64,
                   enable_time_budget=False, speculative_max_batch=8)
    prompt = [5, 9, 200, 31, 7, 11, 13]
    base = LLMEngine(EngineConfig(**options))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    rid = base.add_request(prompt, params)
    ref_outputs, _ = run_engine(base)
    ref = ref_outputs[rid][-1]

    engine = LLMEngine(EngineConfig(speculative_method="ngram", num_speculative_tokens=4, **options))
    _with_oracle(engine, [prompt], [ref.token_ids])
    rid = engine.add_request(prompt, params)
    outputs, _ = run_engine(engine)
    got = outputs[rid][-1]
    assert got.token_ids == ref.token_ids
    assert max(len(o.new_token_ids) for o in outputs[rid]) > 1, "accepted runs arrive together"
    assert len(got.logprobs) == len(ref.logprobs)
    for want, have in zip(ref.logprobs, got.logprobs, strict=True):
        assert want.keys() == have.keys()
        assert all(abs(want[t] - have[t]) < 1e-4 for t in want)

    # A stop string taken from the middle of the greedy text.
    text = ref.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    stop_params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    rid = base.add_request(prompt, stop_params)
    want, _ = run_engine(base)
    engine = LLMEngine(EngineConfig(speculative_method="ngram", num_speculative_tokens=4, **options))
    _with_oracle(engine, [prompt], [ref.token_ids])
    rid2 = engine.add_request(prompt, stop_params)
    have, _ = run_engine(engine)
    assert have[rid2][-1].text == want[rid][-1].text and have[rid2][-1].finish_reason == "stop"
    assert engine.block_manager.num_used_blocks == 0

    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, ignore_eos=True, seed=7)
    runs = []
    for _ in range(2):
        engine = LLMEngine(EngineConfig(speculative_method="ngram", num_speculative_tokens=4, **options))
        _with_oracle(engine, [prompt], [ref.token_ids])
        rid = engine.add_request(prompt, seeded)
        out, _ = run_engine(engine)
        runs.append(out[rid][-1].token_ids)
    assert runs[0] == runs[1]
