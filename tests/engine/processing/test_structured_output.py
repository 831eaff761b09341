"""Structured output (llguidance) and the logprob family (token texts, prompt logprobs,
logit_bias, truncate_prompt_tokens, include_stop_str_in_output) on the tiny model."""
from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams, StructuredOutput
from service.grpc.minivllm_client import InferenceClient
from service.pb import inference_pb2 as pb
from tests.server_harness import ServerThread

REGEX = r"[0-9]{2,4}-[a-z]{3,8}"


def _greedy(llm: LLM, prompt: str | list[int], **params: object) -> object:
    return llm.generate([prompt], SamplingParams(temperature=0, **params))[0]


@pytest.mark.parametrize("seed", range(4))
def test_regex_and_choice_fullmatch_while_sampling(tiny_llm: LLM, seed: int) -> None:
    out = tiny_llm.generate(["The code is"], SamplingParams(temperature=1.0, seed=seed, max_tokens=40,
                                                            structured_output=StructuredOutput("regex", REGEX)))[0]
    assert re.fullmatch(REGEX, out.text), out.text
    assert out.finish_reason == "stop"
    choices = ["alpha", "beta gamma", "delta"]
    out = tiny_llm.generate(["Pick:"], SamplingParams(temperature=1.0, seed=seed, max_tokens=20,
                                                      structured_output=StructuredOutput.choice(choices)))[0]
    assert out.text in choices and out.finish_reason == "stop"


def test_unconstrained_rows_are_untouched_in_a_mixed_batch(tiny_llm: LLM) -> None:
    alone = _greedy(tiny_llm, "hello there", max_tokens=12, ignore_eos=True).token_ids
    mixed = tiny_llm.generate(["hello there", "The code is"], [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, structured_output=StructuredOutput("regex", REGEX))])
    assert mixed[0].token_ids == alone
    assert re.fullmatch(REGEX, mixed[1].text)


def test_cut_off_by_max_tokens_is_length(tiny_llm: LLM) -> None:
    out = _greedy(tiny_llm, "letters:", max_tokens=3, structured_output=StructuredOutput("regex", "[a-z]{60}"))
    assert out.finish_reason == "length" and re.fullmatch("[a-z]*", out.text)


def test_survives_preemption_and_chunked_prefill(tiny_model_dir: Path) -> None:
    # 24 blocks of 4 tokens for 6 requests of ~45 tokens each: sequences get preempted and
    # recomputed mid-generation; a 40-token budget splits the 30-token prompts' prefill too.
    llm = LLM(str(tiny_model_dir), num_kv_blocks=24, block_size=4, max_num_batched_tokens=40, max_num_seqs=6)
    prompt = "one two three four five six seven eight nine ten eleven twelve"
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=24,
                             structured_output=StructuredOutput("regex", r"[0-9]{8,20}")) for s in range(6)]
    outs = llm.generate([prompt] * 6, params)
    for out in outs:
        assert re.fullmatch(r"[0-9]{8,20}", out.text), out.text
    assert any(o.metrics.num_preemptions > 0 for o in outs), "the cache was meant to force preemptions"


def test_invalid_specs_name_the_field(tiny_llm: LLM) -> None:
    for spec, field in ((StructuredOutput("json_schema", '{"type": "objekt"}'), "structured_output.json_schema"),
                        (StructuredOutput("json_schema", "{not json"), "structured_output.json_schema"),
                        (StructuredOutput("regex", "a("), "structured_output.regex"),
                        (StructuredOutput("grammar", "start: (("), "structured_output.grammar")):
        with pytest.raises(ValueError, match=re.escape(field)):
            tiny_llm.generate(["x"], SamplingParams(structured_output=spec))
    with pytest.raises(ValueError, match="structured_output"):
        StructuredOutput("yaml", "a: b")
    with pytest.raises(ValueError, match="structured_output.choice"):
        StructuredOutput.choice([])


def test_logit_bias_forces_and_bans(tiny_llm: LLM) -> None:
    base = _greedy(tiny_llm, "hello", max_tokens=4, ignore_eos=True).token_ids
    forced = _greedy(tiny_llm, "hello", max_tokens=4, ignore_eos=True, logit_bias={7: 100.0}).token_ids
    assert forced == [7] * 4
    banned = _greedy(tiny_llm, "hello", max_tokens=1, ignore_eos=True, logit_bias={base[0]: -100.0}).token_ids
    assert banned[0] != base[0]
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0})
    with pytest.raises(ValueError, match="logit_bias"):
        tiny_llm.generate(["x"], SamplingParams(logit_bias={10**7: 1.0}))


def test_truncate_prompt_tokens_keeps_the_last_ones(tiny_llm: LLM) -> None:
    ids = tiny_llm.engine.tokenize("a b c d e f g h i j k l m n o p")
    out = _greedy(tiny_llm, ids, max_tokens=5, ignore_eos=True, truncate_prompt_tokens=6)
    assert out.prompt_token_ids == ids[-6:]
    assert out.token_ids == _greedy(tiny_llm, ids[-6:], max_tokens=5, ignore_eos=True).token_ids


def test_include_stop_str_in_output(tiny_llm: LLM) -> None:
    text = _greedy(tiny_llm, "once upon", max_tokens=16, ignore_eos=True).text
    stop = text[4:6]
    if not stop.strip():
        pytest.skip("greedy text has no usable stop string")
    cut = text.index(stop)
    assert _greedy(tiny_llm, "once upon", max_tokens=16, ignore_eos=True, stop=[stop]).text == text[:cut]
    kept = _greedy(tiny_llm, "once upon", max_tokens=16, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == text[: cut + len(stop)] and kept.finish_reason == "stop"


@pytest.mark.parametrize("budget", [512, 8])  # whole prompt in one step, and in chunks of 8 tokens
def test_prompt_logprobs_equal_transformers(tiny_model_dir: Path, budget: int) -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM(str(tiny_model_dir), num_kv_blocks=256, block_size=4, max_num_batched_tokens=budget)
    ids = llm.engine.tokenize("the quick brown fox jumps over the lazy dog again and again")
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))[0]
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        expected = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), dim=-1)  # [P, vocab]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for position in range(1, len(ids)):
        entry = out.prompt_logprobs[position]
        row = expected[position - 1]
        assert entry[ids[position]] == pytest.approx(row[ids[position]].item(), abs=1e-4)
        top = row.topk(3)
        for token_id, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert entry[token_id] == pytest.approx(value, abs=1e-4)
        assert len(entry) <= 4


def test_grpc_fields_token_texts_and_invalid_spec(tiny_model_dir: Path) -> None:
    srv = ServerThread(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256))
    try:
        with InferenceClient(srv.target) as client:
            chunks = list(client.generate("The code is", max_tokens=40, temperature=0.7, seed=3, regex=REGEX,
                                          logprobs=2, prompt_logprobs=1))
            text = "".join(c.text for c in chunks)
            assert re.fullmatch(REGEX, text), text
            tokenizer = srv.engine.input_processor.tokenizer
            for chunk in chunks:
                for lp in chunk.logprobs:
                    assert lp.chosen.token == tokenizer.decode([lp.chosen.token_id])
                    assert all(t.token == tokenizer.decode([t.token_id]) for t in lp.top)
            prompt_ids = client.tokenize("The code is")
            assert [lp.chosen.token_id for lp in chunks[0].prompt_logprobs] == prompt_ids[1:]
            assert all(not c.prompt_logprobs for c in chunks[1:])
            choice = pb.SamplingParams(choice=pb.Choices(choices=["yes", "no"]), max_tokens=5, temperature=1.0)
            reply = "".join(c.text for c in client.stub.Generate(pb.GenerateRequest(prompt="ok?", sampling=choice)))
            assert reply in ("yes", "no")
            with pytest.raises(grpc.RpcError) as info:
                list(client.generate("x", json_schema='{"type": "objekt"}'))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "structured_output.json_schema" in info.value.details()
            bias = list(client.generate("x", max_tokens=3, temperature=0, ignore_eos=True, logit_bias={9: 100.0}))
            assert [t for c in bias for t in c.token_ids] == [9, 9, 9]
    finally:
        srv.stop()


@pytest.mark.parametrize("vocab", [1000, 1024, 1037])  # not a multiple of 32, a multiple, and past the mask
def test_bitmask_kernel_and_torch_path_agree(vocab: int) -> None:
    from engine.execution.kernels import load_cpu_kernels
    from engine.processing.structured_output import GrammarMask

    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("C++ kernels unavailable (no compiler): the torch path is what runs")
    words = (1000 + 31) // 32  # the tokenizer's vocabulary is 1000; the model's may be larger
    generator = torch.Generator().manual_seed(vocab)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, words), dtype=torch.int32, generator=generator)
    logits = torch.randn(5, vocab, generator=generator)
    rows = torch.tensor([4, 0, 2])
    fast, slow = logits.clone(), logits.clone()
    GrammarMask(1000, 4, kernels).mask_logits(fast, bitmask, rows)
    GrammarMask(1000, 4, None).mask_logits(slow, bitmask, rows)
    assert torch.equal(fast, slow)
    assert torch.equal(fast[[1, 3]], logits[[1, 3]])  # unconstrained rows untouched
    for i, row in enumerate(rows.tolist()):  # reference: bit v % 32 of word v // 32
        for v in (0, 31, 32, 999, vocab - 1):
            allowed = v < words * 32 and (int(bitmask[i, v // 32]) >> (v % 32)) & 1
            assert (fast[row, v] == -float("inf")) == (not allowed)
