"""Engine behaviour on the tiny random model: stop conditions, streaming text, seeds, errors."""
from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from engine import LLM, LLMEngine, PromptTooLongError, QueueFullError, SamplingParams
from engine.config import EngineConfig
from tests.helpers import run_engine

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def test_greedy_matches_transformers_on_tiny_model(tiny_llm: LLM, tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    prompts = [[5, 9, 13], list(range(10, 80)), [42] * 7, list(range(100, 300, 3))]
    outs = tiny_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=30, min_new_tokens=30, do_sample=False)
        assert out.token_ids == ref[0, len(prompt):].tolist()


def test_same_tokens_alone_and_in_mixed_batch(tiny_llm: LLM) -> None:
    target = list(range(20, 57))
    alone = tiny_llm.generate([target], GREEDY)[0]
    others = [list(range(3, 3 + n)) for n in (5, 90, 17, 33)]
    mixed = tiny_llm.generate(others[:2] + [target] + others[2:], GREEDY)[2]
    assert mixed.token_ids == alone.token_ids


def test_max_tokens_one_finishes_at_prefill(tiny_llm: LLM) -> None:
    engine = tiny_llm.engine
    engine.add_request([4, 5, 6], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    outputs, stats = engine.step()
    assert not engine.has_unfinished_requests()
    assert stats.num_decode_tokens == 0 and stats.num_prefill_tokens == 3
    assert len(outputs) == 1 and outputs[0].finish_reason == "length"
    assert len(outputs[0].token_ids) == 1
    assert engine.block_manager.num_used_blocks == 0


def test_length_finish_and_token_counts(tiny_llm: LLM) -> None:
    out = tiny_llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 7
    assert out.metrics.num_output_tokens == 7 and out.metrics.num_prompt_tokens == 3


def _greedy_text(llm: LLM, prompt: list[int], n: int = 40) -> str:
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].text


def test_stop_string_never_leaks_into_stream(tiny_llm: LLM) -> None:
    prompt = list(range(30, 45))
    full = _greedy_text(tiny_llm, prompt)
    clean = full.replace("\ufffd", "")
    stop = clean[len(clean) // 2 : len(clean) // 2 + 3]
    assert len(stop) == 3
    engine = tiny_llm.engine
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))
    outputs, _ = run_engine(engine)
    streamed = "".join(o.new_text for o in outputs[rid])
    final = outputs[rid][-1]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert stop not in streamed and stop not in final.text
    assert streamed == final.text == full[: full.index(stop)]
    # Every partial stream was a prefix of the final text: nothing was emitted and then taken back.
    assert all(final.text.startswith(o.text) for o in outputs[rid])


def test_stop_token_id_and_eos(tiny_llm: LLM) -> None:
    prompt = [11, 12, 13]
    tokens = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].token_ids
    stop_id = tokens[5]
    first = tokens.index(stop_id)
    out = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == tokens[: first + 1]
    ids = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                     min_tokens=20, stop_token_ids=[stop_id]))[0].token_ids
    assert len(ids) == 20  # min_tokens holds stop tokens off


def test_eos_ends_a_request_unless_ignored(tiny_llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = [11, 12, 13]
    tokens = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].token_ids
    # Declare a token the model really produces as EOS, so the stop is seen end to end.
    eos = tokens[4]
    monkeypatch.setattr(tiny_llm.engine, "eos_token_ids", frozenset({eos}))
    out = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20))[0]
    assert out.finish_reason == "stop" and out.stop_reason is None  # EOS has no stop_reason
    assert out.token_ids == tokens[: tokens.index(eos) + 1]
    ignored = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    assert ignored.finish_reason == "length" and ignored.token_ids == tokens


def test_min_tokens_suppresses_eos(tiny_llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = [[i, i + 1] for i in range(1, 40)]
    params = {"temperature": 1.5, "max_tokens": 12, "seed": 1}
    free_run = tiny_llm.generate(prompts, SamplingParams(ignore_eos=True, **params))
    # The most frequent early token stands in for EOS: the control run shows it would stop requests.
    early = [t for o in free_run for t in o.token_ids[:11]]
    eos = max(set(early), key=early.count)
    monkeypatch.setattr(tiny_llm.engine, "eos_token_ids", frozenset({eos}))
    control = tiny_llm.generate(prompts, SamplingParams(**params))
    assert any(o.finish_reason == "stop" and len(o.token_ids) < 12 for o in control)
    outs = tiny_llm.generate(prompts, SamplingParams(min_tokens=12, **params))
    assert all(len(o.token_ids) == 12 and eos not in o.token_ids for o in outs)


def test_seeded_sampling_repeats_alone_and_in_batch(tiny_llm: LLM) -> None:
    prompt = [3, 1, 4, 1, 5]
    p = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=25, seed=1234, ignore_eos=True)
    a = tiny_llm.generate([prompt], p)[0].token_ids
    b = tiny_llm.generate([[9, 9], prompt, [8] * 20], [SamplingParams(temperature=1.0, max_tokens=5), p,
                                                        SamplingParams(temperature=0.7, max_tokens=9)])[1].token_ids
    c = tiny_llm.generate([prompt], SamplingParams(temperature=1.0, top_p=0.95, max_tokens=25, seed=99,
                                                   ignore_eos=True))[0].token_ids
    assert a == b
    assert a != c


def test_text_is_incremental_decode_of_tokens(tiny_llm: LLM) -> None:
    tok = tiny_llm.tokenizer
    prompt = tok.encode("café 你好 🙂")
    engine = tiny_llm.engine
    rid = engine.add_request(prompt, SamplingParams(temperature=0.8, seed=3, max_tokens=60, ignore_eos=True))
    outputs, _ = run_engine(engine)
    final = outputs[rid][-1]
    assert "".join(o.new_text for o in outputs[rid]) == final.text
    assert final.text == tok.decode(final.token_ids, skip_special_tokens=True).rstrip("\ufffd")


def test_logprobs_equal_an_independent_log_softmax(tiny_llm: LLM, tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    prompt = [5, 6, 7]
    out = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 5
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0].float()
    reference = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]  # the position that chose each token
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert token in entry and 3 <= len(entry) <= 4
        top3 = reference[i].topk(3).indices.tolist()
        assert set(top3) <= set(entry)
        for tid, value in entry.items():
            assert value == pytest.approx(reference[i, tid].item(), abs=1e-4)


def test_abort_frees_blocks_and_reports(tiny_llm: LLM) -> None:
    engine = tiny_llm.engine
    rid = engine.add_request(list(range(1, 50)), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    assert engine.abort_request(rid)
    assert engine.block_manager.num_used_blocks == 0 and engine.num_running == 0
    outputs, _ = engine.step()
    assert [o.finish_reason for o in outputs if o.request_id == rid] == ["abort"]
    assert not engine.has_unfinished_requests()
    assert not engine.abort_request(rid)


def test_stop_sample_ends_one_sample_and_frees_its_blocks(tiny_llm: LLM) -> None:
    """A reader that decided a sample's answer is over (a repeated tool call) stops that sample
    alone: it finishes as a stop, the others go on, and no block is left held."""
    engine = tiny_llm.engine
    rid = engine.add_request(list(range(1, 30)), SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=40,
                                                                ignore_eos=True))
    for _ in range(4):
        engine.step()
    used = engine.block_manager.num_used_blocks
    assert engine.stop_sample(rid, 1)
    assert engine.block_manager.num_used_blocks < used and engine.num_running == 2
    assert not engine.stop_sample(rid, 1)  # already finished: a no-op
    finals = {}
    while engine.has_unfinished_requests():
        outputs, _ = engine.step()
        finals |= {o.index: o for o in outputs if o.request_id == rid and o.is_finished}
    assert finals[1].finish_reason == "stop" and len(finals[1].token_ids) < 40
    assert finals[0].finish_reason == finals[2].finish_reason == "length"
    assert engine.block_manager.count_referenced_blocks() == 0


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -5}, "top_k"),
    ({"min_p": 2}, "min_p"), ({"max_tokens": 0}, "max_tokens"), ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"stop": [""]}, "stop"), ({"logprobs": 100}, "logprobs"), ({"seed": -1}, "seed"),
    ({"stop_token_ids": [-2]}, "stop_token_ids"),
])
def test_bad_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_requests_are_rejected(tiny_llm: LLM) -> None:
    engine = tiny_llm.engine
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("")
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add_request([])
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add_request([1, 10**6])
    with pytest.raises(PromptTooLongError):
        engine.add_request([1] * engine.max_model_len)
    with pytest.raises(ValueError, match="messages\\[0\\].role"):
        engine.apply_chat_template([{"role": "wizard", "content": "hi"}])
    with pytest.raises(ValueError, match="unknown engine option"):
        LLM(None, not_an_option=1)
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)
    assert not engine.has_unfinished_requests()


def test_a_text_longer_than_any_tokenization_could_fit_is_refused_untokenized(
        tiny_llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """No token covers more characters than its vocabulary string has, so a text longer than
    max_token_chars x (max_model_len - 1) characters makes at least max_model_len tokens and cannot
    fit: refused without tokenizing. One character less is tokenized (and judged by its tokens),
    and so is any text under truncate_prompt_tokens."""
    from tokenizers import Tokenizer, models, normalizers
    from transformers import PreTrainedTokenizerFast

    from engine.processing.input_processor import max_token_chars

    engine = tiny_llm.engine
    inputs = engine.input_processor
    vocab = inputs.tokenizer.get_vocab()
    assert inputs.max_token_chars == max(len(t) for t in vocab) > 1
    text = "The quick brown fox, naïve café 2048 times; " * 40
    assert len(inputs.tokenize(text)) * inputs.max_token_chars >= len(text)  # the bound holds on real text
    tokenized: list[str] = []
    tokenize = inputs.tokenize
    monkeypatch.setattr(inputs, "tokenize", lambda prompt: tokenized.append(prompt) or tokenize(prompt))
    limit = inputs.max_token_chars * (engine.max_model_len - 1) + 1  # the fewest characters refused untokenized
    with pytest.raises(PromptTooLongError, match=f"prompt: {limit} characters make at least {engine.max_model_len} "
                                                 "tokens"):
        engine.add_request("a" * limit)
    assert tokenized == []
    with pytest.raises(PromptTooLongError, match="tokens do not fit the context"):  # its tokens judge it
        engine.add_request("a" * (limit - 1))
    assert len(tokenized) == 1
    engine.add_request("a" * limit, SamplingParams(max_tokens=1, truncate_prompt_tokens=8))
    assert len(tokenized) == 2
    while engine.has_unfinished_requests():  # the truncated prompt runs (8 tokens in, 1 out)
        engine.step()
    # A chat is judged by its rendered text, given the request's params; the tokenize route's
    # call (no params) still tokenizes it.
    assert inputs.has_chat_template
    encoded: list[str] = []
    encode = inputs.tokenizer.encode
    monkeypatch.setattr(inputs.tokenizer, "encode", lambda text, **kw: encoded.append(text) or encode(text, **kw))
    chat = [{"role": "user", "content": "a" * limit}]
    with pytest.raises(PromptTooLongError, match="messages: [0-9]+ characters make at least"):
        engine.apply_chat_template(chat, SamplingParams())
    assert encoded == []
    assert len(engine.apply_chat_template(chat)) > engine.max_model_len and len(encoded) == 1
    # A normalizer may delete characters (accents here): no bound, every text is tokenized.
    stripping = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    stripping.normalizer = normalizers.Sequence([normalizers.NFKD(), normalizers.StripAccents()])
    assert max_token_chars(PreTrainedTokenizerFast(tokenizer_object=stripping)) is None


def test_queue_full_backpressure(tiny_model_dir) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, max_num_waiting=3))
    for _ in range(3):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError):
        engine.add_request([1, 2, 3])
    outputs, _ = run_engine(engine)
    assert len(outputs) == 3 and all(o[-1].is_finished for o in outputs.values())


def test_max_model_len_beyond_the_models_positions_is_refused(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="max_model_len 1000000 exceeds"):
        LLM(str(tiny_model_dir), num_kv_blocks=64, max_model_len=1_000_000)


def test_rope_stays_float32_when_the_model_runs_in_bfloat16(tiny_model_dir) -> None:
    """The angles come from float32 frequencies: rounded to bfloat16 (as model.to would round a
    buffer) they are up to 0.4 % off, and the angles drift by radians at a thousand positions."""
    model = LLM(str(tiny_model_dir), num_kv_blocks=64, dtype="bfloat16").engine.runner.model
    positions = torch.tensor([0, 7, 300, model.config.max_position_embeddings - 1])
    cos, sin = model.rope(positions)
    freqs = positions.double().unsqueeze(1) * model.config.inv_freq.double().unsqueeze(0)
    angles = torch.cat((freqs, freqs), dim=-1)  # [4, head_dim]
    assert cos.dtype == sin.dtype == torch.float32
    tol = 1e-6 * model.config.max_position_embeddings  # float32 rounding of position x frequency
    assert torch.allclose(cos.double(), angles.cos() * model.config.rope_scale, atol=tol)
    assert torch.allclose(sin.double(), angles.sin() * model.config.rope_scale, atol=tol)


def test_context_length_caps_generation(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64, max_model_len=40)
    out = llm.generate([list(range(1, 31))], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 10


def test_engine_fault_fails_only_that_step(tiny_llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = tiny_llm.engine
    rid = engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))

    def boom(*_: object) -> None:
        raise RuntimeError("injected fault")

    monkeypatch.setattr(engine.runner, "execute", boom)
    outputs, _ = engine.step()
    assert outputs[0].request_id == rid and outputs[0].finish_reason == "error"
    assert "injected fault" in outputs[0].error
    assert engine.block_manager.num_used_blocks == 0
    monkeypatch.undo()
    assert tiny_llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3))[0].finish_reason is not None


def test_chat_request_uses_template(tiny_llm: LLM) -> None:
    ids = tiny_llm.engine.apply_chat_template([{"role": "user", "content": "Hello world"}])
    text = tiny_llm.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>user\nHello world<|im_end|>") and text.endswith("<|im_start|>assistant\n")
    out = tiny_llm.chat([{"role": "user", "content": "Hello world"}], SamplingParams(max_tokens=4))[0]
    assert out.prompt_token_ids == ids


def test_longest_admissible_prompt_runs_despite_the_watermark(tiny_model_dir) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=100, block_size=4, watermark=0.1,
                                    enable_chunked_prefill=False, max_num_batched_tokens=1024))
    assert engine.max_model_len == 90 * 4
    rid = engine.add_request([5] * (engine.max_model_len - 1), SamplingParams(max_tokens=None, ignore_eos=True))
    outputs, _ = run_engine(engine, max_steps=50)
    assert outputs[rid][-1].finish_reason == "length" and len(outputs[rid][-1].token_ids) == 1


def test_outputs_merge_for_slow_readers(tiny_llm: LLM) -> None:
    engine = tiny_llm.engine
    rid = engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1))
    outputs, _ = run_engine(engine)
    parts = outputs[rid]
    merged = parts[0]
    for part in parts[1:]:
        merged = merged.merged_with(part)
    final = parts[-1]
    assert merged.new_token_ids == final.token_ids and merged.new_text == final.text
    assert merged.is_finished and merged.metrics is final.metrics and len(merged.new_logprobs) == 6
    with pytest.raises(ValueError):
        parts[0].merged_with(tiny_llm.generate([[4, 5]], SamplingParams(max_tokens=1))[0])


def test_generate_is_all_or_nothing_on_bad_input(tiny_llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt_token_ids"):
        tiny_llm.generate([[1, 2, 3], [4, 5], []], SamplingParams(max_tokens=3))
    engine = tiny_llm.engine
    assert not engine.has_unfinished_requests() and engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("isa, max_fused_tokens", [("auto", None), ("auto", 0), ("avx512", None), ("avx2", None),
                                                   ("none", None)])
def test_a_bfloat16_kv_cache_beside_float32_weights(tiny_model_dir, monkeypatch: pytest.MonkeyPatch, isa: str,
                                                    max_fused_tokens: int | None) -> None:
    """kv_cache_dtype=bfloat16: twice the blocks in the same memory, the cache holding the float32
    engine's K/V rounded to bfloat16 (layer 0's, whose inputs no attention has touched yet), and
    logprobs near the float32 cache's through chunked prefill over a cached context and decode:
    on the best kernels (the bf16 pair path on AVX512-BF16), torch's path (no fused layers), the
    widened AVX-512 path, AVX2 and no C++ kernels at all."""
    from engine.execution.kernels import ISAS, load_cpu_kernels

    kernels = load_cpu_kernels()
    if isa == "none":  # no C++ kernels: torch's attention over the gathered cache
        monkeypatch.setenv("MINIVLLM_DISABLE_CPP_KERNELS", "1")
    elif kernels is None or (isa != "auto" and ISAS[isa] > kernels.best_isa()):
        pytest.skip(f"this CPU does not run {isa}")
    else:
        monkeypatch.setenv("MINIVLLM_KERNEL_ISA", isa)
    options = dict(kv_cache_gib=0.01, block_size=4, max_num_batched_tokens=32, max_fused_tokens=max_fused_tokens)
    prompt = [(7 * i) % 200 + 3 for i in range(90)]  # three chunks, the later two over cached ones
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, prompt_logprobs=2, ignore_eos=True)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(str(tiny_model_dir), kv_cache_dtype=dtype, **options)
        runs[dtype] = (llm.engine.runner, llm.generate([prompt], params)[0])
        assert llm.engine.model_info().kv_cache_dtype == f"torch.{dtype}"  # GetModelInfo's
    (fp32, exact), (bf16, rounded) = runs["float32"], runs["bfloat16"]
    assert fp32.kv_cache.dtype == torch.float32 and bf16.kv_cache.dtype == torch.bfloat16
    assert bf16.dtype == torch.float32  # the weights and activations stay float32
    assert bf16.num_kv_blocks in (2 * fp32.num_kv_blocks, 2 * fp32.num_kv_blocks + 1)
    slots = torch.arange(len(prompt))  # a fresh engine's first prompt fills its first blocks in order
    for kv in (0, 1):
        assert torch.equal(bf16.kv_cache[0, kv, slots], fp32.kv_cache[0, kv, slots].to(torch.bfloat16))
    # The random tiny model's logits span tens of nats, so bfloat16 keys move them by a few
    # hundredths (median 0.03-0.04, at most 0.46-0.63 measured); a misread block moves them by nats.
    # The real model's quality cost is held in test_real_model.py.
    diffs = [abs(a[t] - b[t]) for a, b in zip(exact.prompt_logprobs[1:] + exact.logprobs,
                                             rounded.prompt_logprobs[1:] + rounded.logprobs, strict=True)
             for t in a.keys() & b.keys()]
    assert len(diffs) > 200 and statistics.median(diffs) < 0.1 and max(diffs) < 1.0, (statistics.median(diffs), max(diffs))


def test_kv_cache_dtype_is_validated() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8")


def test_the_runners_rows_follow_the_scheduler_through_forks_preemption_and_aborts(tiny_model_dir: Path) -> None:
    """The runner's persistent batch is updated from the step values' diffs only; after every
    step each running request's row holds the scheduler's block table and tokens, and rows of
    requests that ended or were preempted are gone."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=24, block_size=4,
                                    max_num_batched_tokens=32, enable_time_budget=False))
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)
    ids = [engine.add_request([5 + i, 6, 7, 8, 9, 10, 11][: 3 + i], params) for i in range(4)]
    ids.append(engine.add_request([3, 4, 5, 6, 7], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=20,
                                                                    ignore_eos=True)))
    num_preempted, steps = 0, 0
    while engine.has_unfinished_requests():
        _, stats = engine.step()
        steps += 1
        num_preempted += stats.num_preemptions
        if steps == 5:
            engine.abort_request(ids[1])
        rows = engine.runner.batch.rows
        running = {s.request_id: s for s in engine.scheduler.running if s.is_in_runner}
        for req_id, seq in running.items():
            assert rows[req_id].block_table == seq.block_table, req_id
            assert rows[req_id].output_token_ids == seq.output_token_ids, req_id
        waiting = {s.request_id for s in engine.scheduler.waiting}
        assert not waiting & set(rows), "a preempted request keeps no row"
    assert num_preempted > 0, "the pool is small enough to preempt"
    engine.step()  # the last removals reach the runner with the next step
    assert engine.runner.batch.rows == {} and engine.block_manager.num_used_blocks == 0


def test_a_list_of_texts_is_tokenized_in_one_call_as_each_alone(tiny_llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """LLM.generate with several texts tokenizes them in one batch call, to the ids each gets
    alone; a text the batch cannot take (empty, a lone surrogate) falls back to its own checks,
    which name the field, and the prompts accepted before it are not left running."""
    engine = tiny_llm.engine
    inputs = engine.input_processor
    texts = ["Hello there, friend.", "naïve café\n\tx", "a" * 300, "The quick brown fox", "Hello there, friend."]
    alone = [inputs.tokenize(t) for t in texts]
    singles: list[str] = []
    tokenize = inputs.tokenize
    monkeypatch.setattr(inputs, "tokenize", lambda prompt, *a: singles.append(prompt) or tokenize(prompt, *a))
    outs = tiny_llm.generate(texts, SamplingParams(temperature=0, max_tokens=1))
    assert [o.prompt_token_ids for o in outs] == alone
    assert singles == []  # none tokenized one by one
    too_long = "a" * (inputs.max_token_chars * (engine.max_model_len - 1) + 1)  # refused untokenized, alone
    assert engine.encode_prompts(["", "x\ud800", [5, 6], too_long, "ok"]) == [None] * 4 + [inputs.tokenize("ok")]
    from engine.errors import FieldError

    with pytest.raises(FieldError, match="prompt"):
        tiny_llm.generate(["fine", "x\ud800"], SamplingParams(max_tokens=1))
    assert not engine.has_unfinished_requests()
