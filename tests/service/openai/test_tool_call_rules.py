"""The tool-call rules of docs/openai_tools.md on the tiny tool model, sampled: a call cut by
max_tokens is never returned as a call (in every tool_choice mode; its text is content), and a
call that repeats one already made ends the calls (the sample stops there, finish_reason
tool_calls, Responses completed); streamed and whole answers agree, and no KV block is left held."""
from __future__ import annotations

import json
import time
from collections.abc import Iterator

import openai
import pytest

from tests.server_harness import ServerThread
from tests.service.tool_cases import ASK, TOOL_CALL_TOKEN, TOOLS, check_calls, reassemble, whole_answer

EOS = 2  # <|im_end|> in the tiny tool model's tokenizer
# A function whose only arguments are {}: every call of it is the same call.
PING = {"type": "function", "function": {"name": "ping", "description": "Ping",
                                         "parameters": {"type": "object", "properties": {},
                                                        "additionalProperties": False}}}
CHOICES = {"required": {"tool_choice": "required"},
           "named": {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
           "auto": {"logit_bias": {str(TOOL_CALL_TOKEN): 15}}}  # steered to call


@pytest.fixture()
def client(tool_server: ServerThread) -> Iterator[openai.OpenAI]:
    assert tool_server.engine.tokenizer.convert_tokens_to_ids("<|im_end|>") == EOS
    with openai.OpenAI(base_url=tool_server.http_url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


def _no_blocks_held(server: ServerThread) -> None:
    engine = server.engine
    deadline = time.monotonic() + 10
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.count_referenced_blocks() == 0


@pytest.mark.parametrize("choice", list(CHOICES))
def test_calls_cut_by_max_tokens_are_never_returned(tool_server: ServerThread, client: openai.OpenAI,
                                                    choice: str) -> None:
    """8 seeds x n=4 at temperature 0.8 with max_tokens small enough to cut many calls: 0 malformed."""
    num_cut = num_calls = 0
    for seed in range(8):
        out = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, temperature=0.8, seed=seed, n=4,
                                             max_tokens=16 + 12 * seed, **CHOICES[choice])
        for c in out.choices:
            calls = c.message.tool_calls or []
            check_calls(calls)  # every returned call parses and fits its schema
            num_calls += len(calls)
            assert c.finish_reason in ("tool_calls", "length", "stop"), c
            if c.finish_reason == "tool_calls":
                assert calls
            if choice != "auto":  # the grammar makes the answer calls: whole ones, or one cut by max_tokens
                assert calls or c.finish_reason == "length", c
            if c.finish_reason == "length" and "<tool_call>" in (c.message.content or ""):
                num_cut += 1  # the cut call's text came back as content
    assert num_cut >= 4, "max_tokens was meant to cut calls"
    assert num_calls >= 4, "some calls were meant to complete"
    _no_blocks_held(tool_server)


@pytest.mark.parametrize("choice", list(CHOICES))
def test_cut_calls_streamed_and_whole_agree(client: openai.OpenAI, choice: str) -> None:
    for seed in range(4):
        request = dict(model="tiny", messages=ASK, tools=TOOLS, temperature=0.8, seed=seed, max_tokens=14 + 6 * seed,
                       **CHOICES[choice])
        whole = client.chat.completions.create(**request)
        chunks = list(client.chat.completions.create(**request, stream=True))
        streamed = reassemble(chunks)
        assert streamed == whole_answer(whole.choices[0].message, whole.choices[0].finish_reason)
        for _, arguments in streamed["calls"] or []:
            json.loads(arguments)  # no stream showed a call that turned out cut


def _ping_request(**extra: object) -> dict:
    # No end of answer allowed: after its call the model can only call again (the same call).
    return dict(model="tiny", messages=[{"role": "user", "content": "Ping!"}], tools=[PING], tool_choice="required",
                temperature=0.8, max_tokens=400, logit_bias={str(EOS): -100}, **extra)


def test_a_repeated_call_ends_the_calls(tool_server: ServerThread, client: openai.OpenAI) -> None:
    for seed in range(2):
        out = client.chat.completions.create(**_ping_request(seed=seed, n=4))
        for c in out.choices:
            assert c.finish_reason == "tool_calls", c
            assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [("ping", {})]
            assert c.message.content is None
        # Each sample stopped soon after its second call, far short of max_tokens (usage counts
        # what the engine generated, the repeat included).
        assert 4 * 2 * 8 <= out.usage.completion_tokens < 4 * 200, out.usage
        request = _ping_request(seed=seed)
        whole = client.chat.completions.create(**request)
        chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
        assert reassemble(chunks) == whole_answer(whole.choices[0].message, whole.choices[0].finish_reason)
        assert chunks[-1].usage.completion_tokens < 200
    _no_blocks_held(tool_server)


@pytest.mark.parametrize("stream", [False, True])
def test_a_repeated_call_completes_the_response(tool_server: ServerThread, client: openai.OpenAI,
                                                stream: bool) -> None:
    function = {"type": "function", "name": "ping", "description": "Ping",
                "parameters": PING["function"]["parameters"]}
    request = dict(model="tiny", input="Ping!", tools=[function], tool_choice="required", temperature=0.8,
                   max_output_tokens=400, extra_body={"seed": 3, "logit_bias": {str(EOS): -100}})
    if stream:
        events = list(client.responses.create(**request, stream=True))
        assert events[-1].type == "response.completed"
        response = events[-1].response
    else:
        response = client.responses.create(**request)
    assert response.status == "completed" and response.incomplete_details is None
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("ping", {})]
    assert response.usage.output_tokens < 200
    _no_blocks_held(tool_server)


def test_a_cut_call_leaves_the_response_incomplete_with_whole_calls(client: openai.OpenAI) -> None:
    function = {"type": "function", "name": "get_weather", "description": "The weather",
                "parameters": TOOLS[0]["function"]["parameters"]}
    num_cut = 0
    for seed in range(4):
        response = client.responses.create(model="tiny", input="Weather?", tools=[function], tool_choice="required",
                                           temperature=0.8, max_output_tokens=12 + 3 * seed, extra_body={"seed": seed})
        calls = [item for item in response.output if item.type == "function_call"]
        for call in calls:
            json.loads(call.arguments)
            assert call.status == "completed"
        if response.status == "incomplete":
            assert response.incomplete_details.reason == "max_output_tokens"
            num_cut += "<tool_call>" in response.output_text
    assert num_cut >= 1
