"""n > 1 samples of one prompt: prefilled once, sharing the prompt's KV blocks (copy-on-write of
the partly filled last block), reproducible with a seed, one group for preemption."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from service.grpc.minivllm_client import InferenceClient
from tests.server_harness import ServerThread


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), num_kv_blocks=512, block_size=4, max_num_batched_tokens=64)


def test_sample_i_equals_a_lone_request_seeded_seed_plus_i(llm: LLM) -> None:
    """Every sample's tokens are exactly those of an independent request with seed + i: the
    shared prompt blocks and the copied last block hold the right K/V."""
    prompt = "the quick brown fox jumps over"  # not a multiple of the block size: a copy-on-write
    assert len(llm.engine.tokenize(prompt)) % 4 != 0
    out = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True))[0]
    assert [s.index for s in out.samples] == [0, 1, 2, 3]
    for i, sample in enumerate(out.samples):
        alone = llm.generate([prompt], SamplingParams(temperature=1.0, seed=11 + i, max_tokens=12, ignore_eos=True))[0]
        assert sample.token_ids == alone.token_ids and sample.text == alone.text
    assert len({tuple(s.token_ids) for s in out.samples}) > 1, "seeded samples should differ"
    again = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True))[0]
    assert [s.token_ids for s in again.samples] == [s.token_ids for s in out.samples]


def test_greedy_samples_are_identical_and_blocks_are_all_freed(llm: LLM) -> None:
    ids = llm.engine.tokenize("a b c d e f g h")  # also exercises a prompt that fills whole blocks
    for prompt in (ids[:8], ids[:7]):
        out = llm.generate([prompt], SamplingParams(n=3, temperature=0, max_tokens=6, ignore_eos=True))[0]
        alone = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
        assert [s.token_ids for s in out.samples] == [alone.token_ids] * 3
    manager = llm.engine.block_manager
    assert manager.count_referenced_blocks() == 0 == manager.num_used_blocks


def test_n8_of_a_long_prompt_uses_well_under_twice_the_blocks_of_n1(tiny_model_dir: Path) -> None:
    def peak_blocks(n: int) -> int:
        engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=2048, block_size=16,
                                        enable_prefix_caching=False))
        prompt = [(7 * i) % 400 + 5 for i in range(1000)]
        engine.add_request(prompt, SamplingParams(n=n, temperature=1.0, seed=1, max_tokens=32, ignore_eos=True))
        peak = 0
        while engine.has_unfinished_requests():
            engine.step()
            peak = max(peak, engine.block_manager.num_used_blocks)
        return peak

    one, eight = peak_blocks(1), peak_blocks(8)
    assert one >= 63 and eight < 2 * one, (one, eight)


def test_group_preemption_keeps_every_sample_correct(tiny_model_dir: Path) -> None:
    # 40 blocks of 4 tokens for two n=4 requests of ~40 tokens each: samples get preempted.
    llm = LLM(str(tiny_model_dir), num_kv_blocks=40, block_size=4, max_num_batched_tokens=64)
    prompt = "one two three four five six seven"
    outs = llm.generate([prompt, prompt + " eight"],
                        [SamplingParams(n=4, temperature=1.0, seed=s, max_tokens=28, ignore_eos=True) for s in (1, 50)])
    assert any(s.metrics.num_preemptions for o in outs for s in o.samples), "meant to force preemptions"
    roomy = LLM(str(tiny_model_dir), num_kv_blocks=512, block_size=4, max_num_batched_tokens=64)
    for out, base_seed, p in zip(outs, (1, 50), (prompt, prompt + " eight"), strict=True):
        for i, sample in enumerate(out.samples):
            alone = roomy.generate([p], SamplingParams(temperature=1.0, seed=base_seed + i, max_tokens=28,
                                                       ignore_eos=True))[0]
            assert sample.token_ids == alone.token_ids
    assert llm.engine.block_manager.num_used_blocks == 0


def test_grpc_and_openai_report_indices_and_usage_once(tiny_model_dir: Path) -> None:
    srv = ServerThread(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256), http_port=0,
                       served_model_name="tiny")
    try:
        with InferenceClient(srv.target) as client:
            chunks = list(client.generate("hello", n=4, max_tokens=5, temperature=1.0, seed=2, ignore_eos=True))
        finished = [c for c in chunks if c.finish_reason]
        assert sorted(c.index for c in finished) == [0, 1, 2, 3]
        assert sum(len(c.token_ids) for c in chunks) == 20
        with_usage = [c for c in chunks if c.HasField("usage")]
        assert len(with_usage) == 1 and with_usage[0] is chunks[-1]
        assert with_usage[0].usage.completion_tokens == 20 and with_usage[0].usage.prompt_tokens > 0
        with openai.OpenAI(base_url=srv.http_url + "/v1", api_key="x", max_retries=0) as oa:
            whole = oa.completions.create(model="tiny", prompt="hello", n=3, max_tokens=4, temperature=1.0, seed=2,
                                          extra_body={"ignore_eos": True})
            assert [c.index for c in whole.choices] == [0, 1, 2] and whole.usage.completion_tokens == 12
            streamed = list(oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                       n=2, max_tokens=4, stream=True,
                                                       stream_options={"include_usage": True},
                                                       extra_body={"ignore_eos": True}))
            assert {c.choices[0].index for c in streamed if c.choices} == {0, 1}
            assert streamed[-1].usage.completion_tokens == 8
        request = urllib.request.Request(srv.http_url + "/v1/completions", data=json.dumps(
            {"prompt": "x", "n": 0}).encode(), headers={"content-type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=30)
        assert info.value.code == 400 and json.load(info.value)["error"]["param"] == "n"
    finally:
        srv.stop()
