"""Serving Qwen3, Qwen3-MoE and Gemma 3 GGUF files as llama.cpp's own converter writes them (tests.field_gguf):
at f32 both paths, the file's own tensors (quantization gguf) and transformers' conversion of it
(quantization none), generate transformers' greedy tokens on the source checkpoint exactly; at
q8_0 the native blocks stay within the activation rounding of the same file dequantized (the
bounds of test_gguf_serving); `minivllm serve --model FILE.gguf` answers a chat through the
openai SDK with the file's chat template.

Gemma 3's prompts here are longer than its 8-token window, so its sliding layers (0-4) and its
global one (5) both shape the answer. The first load of a Qwen3 file reads a 151,936-token
vocabulary from its metadata (about a minute); later runs find it in the cache. Qwen3-MoE's file
is served through the model's modules (its experts' blocks by the MoeExperts op), not the fused layers.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from engine import LLM, SamplingParams
from engine.execution.backends.cpu_moe import PackedExperts
from engine.execution.weights.quantized_weight import QuantizedWeight
from tests.field_gguf import field_gguf
from tests.helpers import assert_parts_only_at_ties, token_logprobs, transformers_greedy
from tests.server_harness import ServerProcess, free_port, poll

PROMPTS = [[5, 9, 13], list(range(10, 47)), [42] * 7 + list(range(60, 80)), list(range(100, 300, 7))]
NUM_NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
FAMILIES = ["qwen3", "qwen3moe", "gemma3"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def source_tokens(family: str) -> list[list[int]]:
    """transformers' greedy tokens on the checkpoint the files were converted from."""
    return transformers_greedy(field_gguf(family, "f32")[1], PROMPTS, NUM_NEW, dtype=torch.float32)


@pytest.mark.parametrize("quantization", ["gguf", "none"])
def test_an_f32_file_generates_the_source_checkpoints_tokens_exactly(family: str, quantization: str,
                                                                     source_tokens: list[list[int]]) -> None:
    llm = LLM(str(field_gguf(family, "f32")[0]), num_kv_blocks=64, quantization=quantization)
    assert llm.engine.runner.model.config.model_type in (family, f"{family}_text", family.replace("moe", "_moe"))
    outs = [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]
    assert outs == source_tokens
    assert len({tuple(t) for t in outs}) == len(PROMPTS)  # the prompts shape the answers


@pytest.fixture(scope="module")
def q8_twin(family: str) -> LLM:
    """The q8_0 file dequantized to float32 (transformers' conversion): the exact reference for its values."""
    return LLM(str(field_gguf(family, "q8_0")[0]), num_kv_blocks=64, quantization="none")


def test_a_q8_0_file_is_served_as_its_blocks_within_the_activation_rounding(family: str, q8_twin: LLM) -> None:
    llm = LLM(str(field_gguf(family, "q8_0")[0]), num_kv_blocks=64)
    assert llm.engine.config.quantization == "gguf"
    model = llm.engine.runner.model
    projections = [m for layer in model.layers for m in layer.projections if m is not getattr(layer.moe, "router", None)]
    assert all(isinstance(m.panels, QuantizedWeight) for m in projections + [model.lm_head])
    for layer in model.layers:  # Qwen3-MoE: each expert's q8_0 blocks (the converter keeps the router float32)
        if layer.moe is not None:
            experts = layer.moe.experts
            assert isinstance(experts, PackedExperts)
            panels = experts.gate_up_panels + experts.down_panels
            assert len(panels) == 16 and all(w.quant_type == GGMLQuantizationType.Q8_0 for w in panels)
    outs = [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]
    twin = [out.token_ids for out in q8_twin.generate(PROMPTS, GREEDY)]
    assert_parts_only_at_ties(q8_twin, PROMPTS, outs, twin, NUM_NEW)
    ids = list(range(20, 60))
    a, b = token_logprobs(llm, [ids]), token_logprobs(q8_twin, [ids])
    assert np.abs(a - b).max() < 1.5 and np.abs(a - b).mean() < 0.3, (np.abs(a - b).max(), np.abs(a - b).mean())
    assert not np.array_equal(a, b)  # the native path ran its own (integer) products


def test_serve_answers_a_chat_through_the_openai_sdk(family: str, tmp_path: Path) -> None:
    import openai
    from transformers import AutoTokenizer

    path, hf_dir = field_gguf(family, "q8_0")
    http_port = free_port()
    # 512: a chunk is held whole by each of Gemma's six KV-cache groups (its generic tools block is long)
    server = ServerProcess(path, "--http-port", str(http_port), "--num-kv-blocks", "512")
    try:
        assert poll(lambda: "loaded; serving" in server.output or server.proc.poll() is not None, 300), server.output
        assert server.proc.poll() is None, server.output
        messages = [{"role": "user", "content": "Who wrote Hamlet?"}]
        with openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="x", max_retries=0,
                           timeout=120) as client:
            model = client.models.list().data[0].id
            answer = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                                    extra_body={"ignore_eos": True})
            tools = [{"type": "function", "function": {
                "name": "get_weather", "description": "The weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
                               "additionalProperties": False}}}]
            # Qwen3-MoE's random weights open a think block and stay in it past 200 tokens (the
            # call would follow it): its call is asked for with thinking off
            no_thinking = {"chat_template_kwargs": {"enable_thinking": False}} if family == "qwen3moe" else None
            called = client.chat.completions.create(model=model, messages=messages, tools=tools,
                                                    tool_choice="required", max_tokens=200, temperature=0,
                                                    extra_body=no_thinking)
            thinking = {}
            if family.startswith("qwen3"):  # its template's thinking switch, through chat_template_kwargs
                for enable in (True, False):
                    thinking[enable] = client.chat.completions.create(
                        model=model, messages=messages, max_tokens=4, temperature=0,
                        extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": enable}})
        # the prompt is the source checkpoint's own template's rendering, token for token
        tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
        expected = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
        assert answer.usage.prompt_tokens == len(expected)
        assert answer.usage.completion_tokens == 6 and answer.choices[0].message.content
        # a required call always parses, whatever the random weights prefer (200 tokens: the tiny
        # Gemma vocabulary spells the call in short pieces; an enum: a random
        # model's free string would run past max_tokens)
        call = called.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
        for enable, reply in thinking.items():
            rendered = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                     enable_thinking=enable)["input_ids"]
            assert reply.usage.prompt_tokens == len(rendered), enable
        if thinking:  # thinking off: the template writes an empty think block into the prompt
            assert thinking[False].usage.prompt_tokens > thinking[True].usage.prompt_tokens
    finally:
        server.close()
    assert "Traceback" not in server.output, server.output
