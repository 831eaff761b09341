"""Speculative decoding: the proposers, exactness in greedy decoding (every family, whole and
chunked prefill, preemption, n > 1, stop strings, a grammar), the target's distribution kept
when sampling, and no block left behind. Proposals come from an oracle in most tests: the
reference continuation with every third proposal corrupted, so both acceptance and rejection
run on every path (a tiny random model rarely repeats itself for n-grams to find).

Speculative decoding at its edges: the context's and max_tokens' end, a stop string inside an
accepted run, the prefix cache over accepted tokens, grammar logprobs, top-p and seeded sampling
(the verification's distribution and its stream of uniforms), the time budget and the block pool
while verifying, and the proposers' history.
"""
from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams, StructuredOutput
from engine.core.block_manager import BlockManager
from engine.core.scheduler import Scheduler
from engine.core.sequence import SequenceStatus
from engine.execution.sampler import Sampler
from engine.execution.speculative import NgramProposer, SuffixProposer
from engine.execution.speculative.proposer import Proposer
from engine.execution.speculative.token_history import TokenHistory
from tests.helpers import fake_seq, run_engine
from tests.tiny_model import build_tiny_model


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
    from tests.tiny_model import FAMILIES, build_tiny_family_model, family_config

    prompt = [7, 8, 9, 10, 11, 12] * 6
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for family in FAMILIES:
        path = build_tiny_family_model(tmp_path / family, family_config(family))
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


PROMPT = [5, 9, 200, 31, 7, 11, 13]


def _options(model: Path, **overrides: object) -> dict:
    options = dict(model=str(model), num_kv_blocks=256, block_size=4, max_num_batched_tokens=64,
                   enable_time_budget=False, speculative_max_batch=8)
    return {**options, **overrides}


class FixedProposer(Proposer):
    """Proposes from a function of the tokens so far (counts its calls)."""

    method = "ngram"

    def __init__(self, propose: object) -> None:
        self._propose, self.calls = propose, 0

    def propose(self, token_ids: np.ndarray) -> list[int]:
        self.calls += 1
        return self._propose(token_ids)


def test_drafts_stop_at_the_context_and_at_max_tokens(tmp_path: Path) -> None:
    """Proposals that run past the model's context (the RoPE table's last position) and past
    max_tokens are cut: the output equals the run without speculation."""
    path = build_tiny_model(tmp_path / "m", max_position_embeddings=64)
    prompt = [7, 8, 9, 10] * 12  # 48 of the 64 positions
    for max_tokens in (None, 9):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        ref = _generate(LLMEngine(EngineConfig(**_options(path))), [prompt], params)
        engine = LLMEngine(EngineConfig(speculative_method="ngram", num_speculative_tokens=8, **_options(path)))
        # The right tokens, then more past the end: every verification would reach past it.
        reference = ref[0]
        proposer = FixedProposer(lambda t, reference=reference: (reference[len(t) - len(prompt):] + [1] * 8)[:8])
        engine.runner.speculator.proposer = proposer
        assert _generate(engine, [prompt], params) == ref
        assert proposer.calls > 0
        assert len(ref[0]) == (16 if max_tokens is None else max_tokens)


def test_a_stop_string_inside_an_accepted_run_ends_tokens_and_logprobs_there(tiny_model_dir: Path) -> None:
    base = LLMEngine(EngineConfig(**_options(tiny_model_dir)))
    rid = base.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    ref = run_engine(base)[0][rid][-1]
    stop = ref.text[len(ref.text) // 2 : len(ref.text) // 2 + 3]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], logprobs=1)
    rid = base.add_request(PROMPT, params)
    want = run_engine(base)[0][rid]
    engine = LLMEngine(EngineConfig(speculative_method="ngram", num_speculative_tokens=8, **_options(tiny_model_dir)))
    oracle = _with_oracle(engine, [PROMPT], [ref.token_ids])
    oracle.calls = 1  # no corruption before the stop: the stop lands inside an accepted run
    rid = engine.add_request(PROMPT, params)
    have = run_engine(engine)[0][rid]
    assert have[-1].text == want[-1].text and have[-1].finish_reason == "stop"
    assert have[-1].token_ids == want[-1].token_ids
    assert [t for o in have for t in o.new_token_ids] == want[-1].token_ids
    assert len(have[-1].logprobs) == len(want[-1].logprobs) == len(want[-1].token_ids)
    assert have[-1].metrics.num_output_tokens == want[-1].metrics.num_output_tokens


def test_prefix_cache_holds_the_accepted_tokens(tiny_model_dir: Path) -> None:
    """A follow-up whose prompt is the first request's prompt and output hits the cache for the
    same blocks with speculation as without (hashes of the accepted tokens, not of a block
    whose tokens were not yet appended)."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = _generate(LLMEngine(EngineConfig(**_options(tiny_model_dir))), [PROMPT], params)
    hits = {}
    for method in ("none", "ngram"):
        engine = LLMEngine(EngineConfig(speculative_method=method, num_speculative_tokens=4,
                                        **_options(tiny_model_dir)))
        if method != "none":
            _with_oracle(engine, [PROMPT], ref)
        out = _generate(engine, [PROMPT], params)[0]
        assert out == ref[0]
        rid = engine.add_request(PROMPT + out + [1, 2, 3], SamplingParams(temperature=0, max_tokens=1))
        hits[method] = run_engine(engine)[0][rid][-1].metrics.num_cached_tokens
    assert hits["ngram"] == hits["none"] == (len(PROMPT) + 40) // 4 * 4


def test_grammar_logprobs_are_the_models_as_without_speculation(tiny_model_dir: Path) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=2,
                            structured_output=StructuredOutput("json_schema", json.dumps(schema)))
    base = LLMEngine(EngineConfig(**_options(tiny_model_dir, max_num_batched_tokens=32)))
    rid = base.add_request(PROMPT, params)
    ref = run_engine(base)[0][rid][-1]
    engine = LLMEngine(EngineConfig(speculative_method="ngram", num_speculative_tokens=4,
                                    **_options(tiny_model_dir, max_num_batched_tokens=32)))
    _with_oracle(engine, [PROMPT], [ref.token_ids])
    rid = engine.add_request(PROMPT, params)
    outputs = run_engine(engine)[0][rid]
    got = outputs[-1]
    assert got.token_ids == ref.token_ids
    assert max(len(o.new_token_ids) for o in outputs) > 1, "some drafts were accepted"
    for want, have in zip(ref.logprobs, got.logprobs, strict=True):
        assert want.keys() == have.keys()
        assert all(abs(want[t] - have[t]) < 1e-4 for t in want)


class _Row:
    def __init__(self, params: SamplingParams, generator: torch.Generator | None = None) -> None:
        self.params, self.prompt_token_ids, self.output_token_ids = params, [1], []
        self.generator, self.matcher, self.min_tokens_stop_ids = generator, None, frozenset()
        self.num_output_tokens = 0


@pytest.mark.parametrize("params,target", [
    (SamplingParams(temperature=1.0, top_p=0.7), [0.375, 0.625, 0.0]),  # top-p keeps {0, 1}
    (SamplingParams(temperature=1.0, min_p=0.5), [0.375, 0.625, 0.0]),  # min-p keeps p >= 0.25: {0, 1}
], ids=["top-p", "min-p"])
def test_verification_samples_the_truncated_distribution_renormalised(params: SamplingParams,
                                                                       target: list[float]) -> None:
    """p = [0.3, 0.5, 0.2]; draft = token 0. The output must follow p after top-p / min-p,
    renormalised (the kept mass is not 1)."""
    sampler = Sampler(torch.device("cpu"))
    sampler.generator.manual_seed(0)
    logits = torch.tensor([0.3, 0.5, 0.2]).log().expand(2, -1)
    counts: Counter = Counter()
    num = 20000
    for _ in range(num):
        tokens, _ = sampler.verify(logits.clone(), [_Row(params), _Row(params)], [(0, [0])])
        counts[tokens[0][0]] += 1
    for token, p in enumerate(target):
        assert abs(counts[token] / num - p) < 0.015, (counts, target)


def test_a_seeded_verification_uses_one_uniform_per_emitted_token() -> None:
    """The request's stream advances by the tokens it emits, as one token a step would."""
    params = SamplingParams(temperature=1.0, seed=3)
    sampler = Sampler(torch.device("cpu"))
    logits = torch.tensor([[0.0, 0.0, 9.0]] * 4)  # token 2 nearly always
    generator = torch.Generator().manual_seed(3)
    rows = [_Row(params, generator) for _ in range(4)]
    tokens, _ = sampler.verify(logits.clone(), rows, [(0, [2, 0, 2])])  # accepts 2, rejects 0
    assert tokens == [[2, 2]]
    expected = torch.Generator().manual_seed(3)
    torch.rand(2, dtype=torch.float64, generator=expected)
    assert torch.equal(generator.get_state(), expected.get_state())


def test_seeded_sampling_is_the_same_with_and_without_speculation_in_any_batch(tiny_model_dir: Path) -> None:
    prompt = [7, 8, 9, 10] * 6
    seeded = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, ignore_eos=True, seed=7)
    options = _options(tiny_model_dir, num_kv_blocks=512, max_num_batched_tokens=256)
    ref_engine = LLMEngine(EngineConfig(**options))
    rid = ref_engine.add_request(prompt, seeded)
    ref = run_engine(ref_engine)[0][rid][-1].token_ids
    results = []
    for num_others in (0, 3):
        engine = LLMEngine(EngineConfig(speculative_method="ngram", num_speculative_tokens=4, **options))
        # Drafts from the reference (some wrong): acceptance and rejection both run.
        engine.runner.speculator.proposer = FixedProposer(
            lambda t: ([*ref, 0, 0][len(t) - len(prompt):][:2] + [3, 4]))
        rid = engine.add_request(prompt, seeded)
        for _ in range(num_others):
            engine.add_request([3, 4, 5, 6] * 5, SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True))
        outputs = run_engine(engine)[0][rid]
        assert max(len(o.new_token_ids) for o in outputs) > 1, "some drafts were accepted"
        results.append(outputs[-1].token_ids)
    assert results == [ref, ref]


def test_the_time_budget_holds_steps_that_verify(tiny_model_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(**_options(tiny_model_dir, num_kv_blocks=512, max_num_batched_tokens=512,
                                               enable_time_budget=True, speculative_method="ngram")))
    engine.runner.speculator.proposer = FixedProposer(lambda t: [1, 2, 3])
    engine.add_request([7, 8, 9, 10] * 6, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    sources = []
    for step in range(40):
        if step == 20:
            engine.add_request(list(range(20, 400)), SamplingParams(temperature=0, max_tokens=2))
        _, stats = engine.step()
        if stats.num_prefill_tokens and step >= 20:
            sources.append((stats.budget_source, stats.num_verify_tokens))
    assert any(verify for _, verify in sources), "some prefill steps also verified"
    assert all(source == "time" for source, _ in sources), sources


def _two_decodes(bm: BlockManager, with_drafts: bool) -> Scheduler:
    sched = Scheduler(EngineConfig(max_num_batched_tokens=64, enable_time_budget=False,
                                   speculative_method="ngram", speculative_max_batch=8), bm)
    for rid, arrival in (("a", 0.0), ("b", 1.0)):
        seq = fake_seq(rid, 8, num_output=1, arrival=arrival)  # 9 tokens, 8 computed: the 9th needs a 3rd block
        assert bm.allocate(seq, 8)
        seq.num_computed_tokens = 8
        seq.status = SequenceStatus.RUNNING
        sched.running.append(seq)
    if with_drafts:
        sched.running[0].spec_token_ids = [1, 2, 3, 4]  # 9 + 4 tokens: 4 blocks
    return sched


def test_speculation_never_preempts_a_plain_decode() -> None:
    out = _two_decodes(BlockManager(6, 4, enable_prefix_caching=False), True).schedule(now=2.0)
    assert out.preempted_req_ids == [] and sorted(out.decode_req_ids) == ["a", "b"]
    out = _two_decodes(BlockManager(16, 4, enable_prefix_caching=False), True).schedule(now=2.0)
    assert out.verify_req_ids == ["a"] and out.verify_draft_ids == [[1, 2, 3, 4]], "room to spare: it verifies"


def _ngram_reference(token_ids: np.ndarray, num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """The definition: the latest earlier occurrence of the longest suffix n-gram."""
    tokens = token_ids.tolist()
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                return tokens[start + n : start + n + num_tokens]
    return []


def test_ngram_matches_its_definition_on_random_histories() -> None:
    rng = np.random.default_rng(0)
    proposer = NgramProposer(num_tokens=5, min_n=2, max_n=4)
    for _ in range(300):
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 60)))
        assert proposer.propose(tokens) == _ngram_reference(tokens, 5, 2, 4), tokens.tolist()


def test_token_history_grows_with_the_output() -> None:
    history = TokenHistory([1, 2, 3])
    output: list[int] = []
    for token in range(100):
        output.append(token)
        assert history.view(output).tolist() == [1, 2, 3, *output]


def test_a_served_stream_carries_an_accepted_run_in_one_message(tiny_model_dir: Path) -> None:
    """gRPC and SSE: a verification's accepted tokens arrive together, once, in order. Steps are
    slowed so the stream never merges two steps' outputs (then only a verification can put
    several tokens in one message)."""
    import openai

    from service.grpc.minivllm_client import InferenceClient
    from tests.server_harness import ServerThread

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reference = _generate(LLMEngine(EngineConfig(**_options(tiny_model_dir))), [PROMPT], params)
    config = EngineConfig(speculative_method="ngram", num_speculative_tokens=4, **_options(tiny_model_dir))

    def speculating_engine() -> LLMEngine:
        engine = LLMEngine(config)
        _with_oracle(engine, [PROMPT], reference)
        step = engine.step
        engine.step = lambda: (time.sleep(0.01), step())[1]
        return engine

    srv = ServerThread(config, http_port=0, served_model_name="tiny", engine_factory=speculating_engine)
    try:
        with InferenceClient(srv.target) as c:
            chunks = [list(m.token_ids) for m in c.generate(PROMPT, max_tokens=24, temperature=0, ignore_eos=True)]
        assert [t for ids in chunks for t in ids] == reference[0]
        assert max(map(len, chunks)) > 1
        with openai.OpenAI(base_url=srv.http_url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
            stream = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                          logprobs=1, extra_body={"ignore_eos": True})
            events = [e.choices[0] for e in stream if e.choices]
        assert max(len(e.logprobs.tokens) for e in events if e.logprobs) > 1
        assert sum(len(e.logprobs.tokens) for e in events if e.logprobs) == 24
    finally:
        srv.stop()


def test_reset_speculative_history_forgets_finished_requests(tiny_model_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(speculative_method="suffix", **_options(tiny_model_dir)))
    proposer = engine.runner.speculator.proposer
    proposer.observe_finished(np.array([6, 7, 50, 51, 52]))
    assert proposer.propose(np.array([3, 6, 7])) == [50, 51]
    engine.reset_speculative_history()
    assert proposer.propose(np.array([3, 6, 7])) == []


def test_vllm_contract_reports_a_samples_speculation(tiny_model_dir: Path) -> None:
    from service.grpc.vllm_protocol import complete_response

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reference = _generate(LLMEngine(EngineConfig(**_options(tiny_model_dir))), [PROMPT], params)
    engine = LLMEngine(EngineConfig(speculative_method="ngram", num_speculative_tokens=4, **_options(tiny_model_dir)))
    _with_oracle(engine, [PROMPT], reference)
    rid = engine.add_request(PROMPT, params)
    final = run_engine(engine)[0][rid][-1]
    msg = complete_response(final, params, is_stream=False).complete
    assert list(msg.output_ids) == reference[0]
    assert msg.spec_draft_tokens == final.metrics.num_draft_tokens > msg.spec_accepted_tokens > 0
    assert msg.spec_accepted_tokens == final.metrics.num_accepted_tokens
