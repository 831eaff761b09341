"""Speculative decoding at its edges: the context's and max_tokens' end, a stop string inside an
accepted run, the prefix cache over accepted tokens, grammar logprobs, top-p and seeded sampling
(the verification's distribution and its stream of uniforms), the time budget and the block pool
while verifying, and the proposers' history."""
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
from engine.execution.speculative import NgramProposer
from engine.execution.speculative.proposer import Proposer
from engine.execution.speculative.token_history import TokenHistory
from tests.helpers import fake_seq, run_engine
from tests.test_speculative import _generate, _with_oracle
from tests.tiny_model import build_tiny_model

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
