"""A step's last layer past attention runs only for the rows anything reads after it: the rows
it samples (a prompt's last chunk's last row, decode and verification rows) and the rows it pools;
every row when a chunk asks for prompt logprobs. Tiny random model, greedy output against
transformers."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams


def _spy_rows(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, list[int] | None]]:
    """(num_tokens, output_rows) of each forward the runner makes through the backend."""
    seen: list[tuple[int, list[int] | None]] = []
    backend = llm.engine.runner.backend
    forward = backend.forward

    def spy(model, input_ids, positions, attn, kv_caches, **inputs):  # noqa: ANN001, ANN202
        rows = inputs.get("output_rows")
        seen.append((len(input_ids), None if rows is None else rows.tolist()))
        return forward(model, input_ids, positions, attn, kv_caches, **inputs)

    monkeypatch.setattr(backend, "forward", spy)
    return seen


def test_chunks_read_back_only_the_rows_they_sample(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM(str(tiny_model_dir), num_kv_blocks=64, block_size=4, max_num_batched_tokens=32)
    seen = _spy_rows(llm, monkeypatch)
    prompt = list(range(10, 80))  # 70 tokens: chunks of 32, 32 and 6
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert out.token_ids == ref[0, len(prompt):].tolist()
    assert seen[:3] == [(32, []), (32, []), (6, [5])]  # two chunks sample nothing, the last its last row

    # two prompts in one step beside a decoding one: each prompt's last row and the decode row
    seen.clear()
    engine = llm.engine
    engine.add_request(list(range(3, 9)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()  # its prefill: it decodes from now on
    engine.add_request(list(range(20, 25)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine.add_request(list(range(30, 37)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine.step()
    assert seen[-1] == (5 + 7 + 1, [4, 11, 12])
    while engine.has_unfinished_requests():
        engine.step()

    # every row read (two one-token prompts): no rows passed, so no gather and scatter of the step
    engine.add_request([7], SamplingParams(temperature=0, max_tokens=1))
    engine.add_request([8], SamplingParams(temperature=0, max_tokens=1))
    engine.step()
    assert seen[-1] == (2, None)


def test_prompt_logprobs_read_every_row(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64, block_size=4, max_num_batched_tokens=64)
    seen = _spy_rows(llm, monkeypatch)
    prompt = list(range(10, 30))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    assert seen[0] == (20, None)
    assert len(out.prompt_logprobs) == len(prompt)
