"""Reasoning parsers: their examples cut at every character, and a server with
reasoning_parser=deepseek_r1 on the tiny tool model, steered to close its thinking block
(a bias toward </think>) and constrained to a JSON answer after it, streamed and not."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from service.chat.reasoning_parser import get_reasoning_parser
from tests.server_harness import ServerThread
from tests.service.tool_cases import (
    ANSWER,
    ASK,
    END_THINK,
    THINK,
    TOOL_CALL_TOKEN,
    TOOLS,
    check_calls,
    reassemble,
    whole_answer,
)

EXAMPLES = [  # (parser, text, reasoning, content)
    ("deepseek_r1", "<think>\nLet me see.\n</think>\n\nThe answer is 4.", "\nLet me see.\n", "The answer is 4."),
    ("deepseek_r1", "Prompt opened it; 2+2</think>4", "Prompt opened it; 2+2", "4"),
    ("deepseek_r1", "still thinking, cut off </thi", "still thinking, cut off </thi", ""),
    ("deepseek_r1", "</think>", "", ""),
    ("qwen3", "<think>hmm</think>\nYes.", "hmm", "Yes."),
    ("qwen3", "No thinking <think>here</think>", "", "No thinking <think>here</think>"),
    ("qwen3", "  <think>a < b</think> ok", "a < b", "ok"),
    ("qwen3", "<thin", "", "<thin"),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), EXAMPLES)
def test_reasoning_parser_whole_and_cut_at_every_character(name: str, text: str, reasoning: str, content: str) -> None:
    def run(pieces: list[str]) -> tuple[str, str]:
        stream = get_reasoning_parser(name).new_stream()
        parts = [stream.feed(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
        return "".join(r for r, _ in parts), "".join(c for _, c in parts)

    assert run([text]) == (reasoning, content)
    for cut in range(len(text) + 1):
        assert run([text[:cut], text[cut:]]) == (reasoning, content), cut
    assert run([*text, ""]) == (reasoning, content)



def _inside_block(tokens: list[str], starts_in_reasoning: bool) -> int:
    """The tokens between the thinking block's markers (the markers not counted)."""
    if tokens[:1] == ["<think>"]:
        tokens = tokens[1:]
    elif not starts_in_reasoning:
        return 0
    return tokens.index("</think>") if "</think>" in tokens else len(tokens)


def test_thinking_block_is_reasoning_and_the_grammar_applies_after_it(reasoning_server: ServerThread) -> None:
    request = dict(model="tiny", messages=ASK, temperature=0.8, max_tokens=200, logit_bias={str(END_THINK): 15},
                   response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}},
                   logprobs=True)
    num_thought = 0
    with openai.OpenAI(base_url=reasoning_server.http_url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
        for seed in range(4):
            whole = client.chat.completions.create(**request, seed=seed)
            message, usage = whole.choices[0].message, whole.usage
            assert whole.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(message.content), ANSWER)  # constrained after the block only
            assert "</think>" not in message.content
            num_thought += bool(message.reasoning_content)
            assert 0 < usage.completion_tokens_details.reasoning_tokens < usage.completion_tokens
            tokens = [t.token for t in whole.choices[0].logprobs.content]
            assert usage.completion_tokens_details.reasoning_tokens == _inside_block(tokens, True)
            chunks = list(client.chat.completions.create(**request, seed=seed, stream=True))
            assert reassemble(chunks) == whole_answer(message, "stop")
        unconstrained = client.chat.completions.create(model="tiny", messages=ASK, temperature=0.8, seed=0,
                                                       max_tokens=30)
    assert num_thought >= 2
    # Without a bias the tiny model never closes the block: all of it is reasoning.
    assert unconstrained.choices[0].message.reasoning_content and not unconstrained.choices[0].message.content


QWEN3 = pytest.mark.parametrize("reasoning_server", ["qwen3"], indirect=True)
JSON_ANSWER = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}


def test_grpc_uses_the_servers_reasoning_parser(reasoning_server: ServerThread) -> None:
    """gRPC chat answers are parsed with the server's options too: thinking in reasoning_text."""
    from service.grpc.minivllm_client import InferenceClient
    from service.pb import inference_pb2 as pb

    request = pb.GenerateRequest(messages=pb.Messages(messages=[pb.ChatMessage(role="user", content="2+2?")]),
                                 sampling=pb.SamplingParams(temperature=0.8, seed=0, max_tokens=40,
                                                            logit_bias={END_THINK: 8}))
    with InferenceClient(reasoning_server.target) as c:
        responses = list(c.stub.Generate(request))
    reasoning = "".join(r.reasoning_text for r in responses)
    assert reasoning and "</think>" not in "".join(r.text for r in responses)
    assert responses[-1].usage.reasoning_tokens > 0


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_tools_and_reasoning_together(reasoning_server: ServerThread, choice: str) -> None:
    """Thinking first, then the call (required, or auto steered toward <tool_call>): the block is
    reasoning, the call parses and validates, the stream reassembles into the whole answer."""
    request = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0.8, max_tokens=200,
                   parallel_tool_calls=False, logprobs=True,
                   logit_bias={str(END_THINK): 12, str(TOOL_CALL_TOKEN): 12})
    num_thought = 0
    with openai.OpenAI(base_url=reasoning_server.http_url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
        for seed in range(3):
            whole = client.chat.completions.create(**request, seed=seed)
            choice_out = whole.choices[0]
            message = choice_out.message
            assert choice_out.finish_reason == "tool_calls" and len(message.tool_calls) == 1, choice_out
            check_calls(message.tool_calls)
            assert "<tool_call>" not in (message.content or "") and "</think>" not in (message.reasoning_content or "")
            num_thought += bool(message.reasoning_content)
            tokens = [t.token for t in choice_out.logprobs.content]
            assert whole.usage.completion_tokens_details.reasoning_tokens == _inside_block(tokens, True)
            chunks = list(client.chat.completions.create(**request, seed=seed, stream=True))
            assert reassemble(chunks) == whole_answer(message, "tool_calls")
    assert num_thought >= 2


# Last: the fixture's qwen3 server starts once, after the deepseek_r1 one has served its tests.
@QWEN3
def test_qwen3_without_thinking_is_constrained_from_the_first_token(reasoning_server: ServerThread) -> None:
    """qwen3 thinks only when the answer opens the block: one that does not is held to the
    answer's grammar (a JSON format, a required call) from its first token, with no reasoning."""
    never = {str(THINK): -100}
    with openai.OpenAI(base_url=reasoning_server.http_url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
        for seed in range(3):
            out = client.chat.completions.create(model="tiny", messages=ASK, temperature=0.8, seed=seed,
                                                 max_tokens=100, logit_bias=never, response_format=JSON_ANSWER)
            message = out.choices[0].message
            jsonschema.validate(json.loads(message.content), ANSWER)
            assert message.reasoning_content is None and out.usage.completion_tokens_details.reasoning_tokens == 0
            out = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                                 parallel_tool_calls=False, temperature=0.8, seed=seed,
                                                 max_tokens=150, logit_bias=never)
            choice = out.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
            check_calls(choice.message.tool_calls)


@QWEN3
def test_qwen3_reasoning_tokens_are_the_blocks_own(reasoning_server: ServerThread) -> None:
    """A thinking answer (steered to open and then close the block): usage counts exactly the
    tokens between <think> and </think>, and the answer after it is constrained."""
    request = dict(model="tiny", messages=ASK, temperature=0.8, max_tokens=200, logprobs=True,
                   logit_bias={str(THINK): 30, str(END_THINK): 12}, response_format=JSON_ANSWER)
    num_thought = 0
    with openai.OpenAI(base_url=reasoning_server.http_url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
        for seed in range(3):
            whole = client.chat.completions.create(**request, seed=seed)
            message = whole.choices[0].message
            tokens = [t.token for t in whole.choices[0].logprobs.content]
            assert tokens[0] == "<think>" and "</think>" in tokens, tokens
            assert whole.usage.completion_tokens_details.reasoning_tokens == _inside_block(tokens, False)
            jsonschema.validate(json.loads(message.content), ANSWER)
            num_thought += bool(message.reasoning_content)
            chunks = list(client.chat.completions.create(**request, seed=seed, stream=True))
            assert reassemble(chunks) == whole_answer(message, "stop")
    assert num_thought >= 2
