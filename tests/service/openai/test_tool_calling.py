"""Chat tool calling with the official `openai` SDK against the server, on the tiny random
model: garbage text, so a call that parses shows the grammar at work. Two servers: the plain
tiny model (its template knows no tools: the generic format) and the tool model (a template
that renders tools=, and <tool_call> as an added token, as in Qwen's tokenizers)."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import jsonschema
import openai
import pydantic
import pytest

from tests.server_harness import ServerThread
from tests.service.tool_cases import (
    ASK,
    TIME,
    TOOL_CALL_TOKEN,
    TOOLS,
    WEATHER,
    check_calls,
    reassemble,
    start_server,
    whole_answer,
)


@pytest.fixture(scope="module")
def generic_server(tiny_model_dir: Path) -> Iterator[ServerThread]:
    srv = start_server(tiny_model_dir)
    yield srv
    srv.stop()


def _client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_calls_always_parse(generic_server: ServerThread, choice: str) -> None:
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_time"}}
    num_calls = 0
    with _client(generic_server) as client:
        for seed in range(8):
            out = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                                                 parallel_tool_calls=False, temperature=0.8, seed=seed, n=4,
                                                 max_tokens=120)
            for c in out.choices:
                assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
                assert c.message.content is None
                check_calls(c.message.tool_calls)
                if choice == "named":
                    assert c.message.tool_calls[0].function.name == "get_time"
                num_calls += 1
    assert num_calls == 32  # 0 malformed out of 32


def test_auto_call_started_by_the_model_parses(tool_server: ServerThread) -> None:
    """auto: free text until the model opens a call (steered here: a bias toward <tool_call>),
    then the call is held to its schema."""
    calls, texts = [], []
    with _client(tool_server) as client:
        for seed in range(3):
            out = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, temperature=0.8, seed=seed,
                                                 n=4, max_tokens=150, parallel_tool_calls=False,
                                                 logit_bias={str(TOOL_CALL_TOKEN): 15})
            for c in out.choices:
                if c.finish_reason == "tool_calls":
                    calls += c.message.tool_calls
                    assert len(c.message.tool_calls) == 1
                texts.append(c.message.content or "")
                assert "<tool_call>" not in (c.message.content or "")
        plain = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, temperature=0.8, seed=0,
                                               max_tokens=20)
    assert len(calls) >= 4, "the steered model was meant to call"
    check_calls(calls)
    assert any(texts), "text before a call is content"
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content  # unsteered: text


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_parallel_calls(tool_server: ServerThread, choice: str) -> None:
    """Several calls in one answer (auto: steered toward <tool_call>); every returned call parses,
    also when the sampled tiny model goes on calling until max_tokens (finish_reason length: the
    call it cut is content, not a call)."""
    bias = {str(TOOL_CALL_TOKEN): 15} if choice == "auto" else None
    with _client(tool_server) as client:
        out = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice,
                                             temperature=0.8, seed=3, n=8, max_tokens=300, logit_bias=bias)
    most = 0
    for c in out.choices:
        calls = c.message.tool_calls or []
        assert c.finish_reason in ("tool_calls", "length")
        check_calls(calls)
        most = max(most, len(calls))
    assert most >= 2


@pytest.mark.parametrize("stop", [",", "</tool_call>"])
def test_auto_call_cut_by_a_stop_string_is_content(tool_server: ServerThread, stop: str) -> None:
    """A stop string that ends the answer inside a call (the comma after its name) leaves no
    call: the text comes back as content, finish_reason stop, streamed and not. One past the
    call's JSON (its closing tag) leaves it whole: a call, finish_reason tool_calls."""
    num_cut = num_called = 0
    with _client(tool_server) as client:
        for seed in range(3):
            request = dict(model="tiny", messages=ASK, tools=TOOLS, temperature=0.8, seed=seed, max_tokens=150,
                           parallel_tool_calls=False, logit_bias={str(TOOL_CALL_TOKEN): 15}, stop=[stop])
            whole = client.chat.completions.create(**request)
            choice = whole.choices[0]
            chunks = list(client.chat.completions.create(**request, stream=True))
            assert reassemble(chunks) == whole_answer(choice.message, choice.finish_reason)
            if choice.finish_reason == "tool_calls":
                check_calls(choice.message.tool_calls)
                num_called += 1
            else:
                assert choice.message.tool_calls is None, choice
                num_cut += "<tool_call>" in (choice.message.content or "")
    if stop == ",":
        assert num_cut >= 2 and num_called == 0
    else:
        assert num_called >= 2


@pytest.mark.parametrize("case", ["required-parallel", "auto-steered", "auto-text"])
def test_streamed_deltas_reassemble_into_the_answer(tool_server: ServerThread, case: str) -> None:
    kwargs: dict = {"tool_choice": "required"} if case == "required-parallel" else {}
    if case == "auto-steered":
        kwargs["logit_bias"] = {str(TOOL_CALL_TOKEN): 15}
    with _client(tool_server) as client:
        for seed in range(3):
            request = dict(model="tiny", messages=ASK, tools=TOOLS, temperature=0.8, seed=seed, max_tokens=200, **kwargs)
            whole = client.chat.completions.create(**request)
            chunks = list(client.chat.completions.create(**request, stream=True))
            assert reassemble(chunks) == whole_answer(whole.choices[0].message, whole.choices[0].finish_reason)
            if case != "auto-text":
                assert whole.choices[0].message.tool_calls, "a call was meant to be in the answer"


def test_multi_turn_with_a_tool_result(generic_server: ServerThread, tool_server: ServerThread) -> None:
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"},
        {"role": "user", "content": "And should I take an umbrella?"}]
    # The tool model's template renders tools= and the call (arguments as an object) and result.
    tokenizer = tool_server.engine.tokenizer
    templated = json.loads(json.dumps(history))
    templated[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris", "days": 3}
    templated[1]["content"] = ""
    text = tokenizer.apply_chat_template(templated, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "Sunny, 24 C" in text and '"get_time"' in text and '{"city": "Paris", "days": 3}' in text
    for server, expected in ((tool_server, len(tokenizer.encode(text, add_special_tokens=False))), (generic_server, None)):
        with _client(server) as client:
            out = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, temperature=0,
                                                 max_tokens=8)
            if expected is not None:
                assert out.usage.prompt_tokens == expected
            assert out.choices[0].message.content  # answered in text
            without = client.chat.completions.create(model="tiny", messages=history[:1] + history[-1:],
                                                     tools=TOOLS, temperature=0, max_tokens=1)
            assert out.usage.prompt_tokens > without.usage.prompt_tokens + 10  # the call and its result count


def test_generic_format_renders_tools_calls_and_results(generic_server: ServerThread) -> None:
    from service.chat.tool_grammar import FunctionSpec
    from service.chat.tool_parsers import get_tool_parser
    from service.chat.tools import generic_messages

    history = [{"role": "system", "content": "Be brief."}, ASK[0],
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]},
               {"role": "tool", "content": "12:00", "tool_call_id": "c"}, {"role": "tool", "content": "ok"}]
    out = generic_messages(history, get_tool_parser("hermes"), [FunctionSpec("get_time", "The time", TIME)])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.") and '"name": "get_time"' in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    assert out[3]["content"] == "<tool_response>\n12:00\n</tool_response>\n<tool_response>\nok\n</tool_response>"


class Forecast(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=8)
    days: int = pydantic.Field(ge=1, le=7)
    rain: bool


def test_chat_completions_parse_with_pydantic(generic_server: ServerThread) -> None:
    with _client(generic_server) as client:
        for seed in range(3):
            out = client.chat.completions.parse(model="tiny", messages=ASK, response_format=Forecast,
                                                temperature=0.8, seed=seed, max_tokens=200)
            assert isinstance(out.choices[0].message.parsed, Forecast)
        out = client.chat.completions.parse(model="tiny", messages=ASK, tools=[openai.pydantic_function_tool(Forecast)],
                                            tool_choice="required", temperature=0.8, seed=1, max_tokens=200)
        call = out.choices[0].message.tool_calls[0]
        assert isinstance(call.function.parsed_arguments, Forecast)


@pytest.mark.parametrize(("body", "param"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].name"),
    ({"guided_regex": "[a-z]+"}, "tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "p": {"type": "strin"}}}}}], "tool_choice": "required"}, "tools"),  # the grammar compiler's refusal
    ({"tool_choice": "required", "stop": [","]}, "stop"),  # a stop string could only cut the call
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}, "stop": "}"}, "stop"),
])
def test_bad_tool_requests_name_the_field(generic_server: ServerThread, body: dict, param: str) -> None:
    request = {"model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": 4} | body
    extra = {k: request.pop(k) for k in list(request) if k.startswith("guided_")}
    with _client(generic_server) as client, pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**request, extra_body=extra)
    assert info.value.body["param"] == param, info.value.body


def test_grpc_tools_and_parsed_calls(generic_server: ServerThread) -> None:
    from service.grpc.minivllm_client import InferenceClient
    from service.pb import inference_pb2 as pb

    request = pb.GenerateRequest(
        messages=pb.Messages(messages=[pb.ChatMessage(role="user", content="Weather?")], tool_choice="required",
                             tools=[pb.FunctionTool(name="get_weather", parameters=json.dumps(WEATHER))],
                             parallel_tool_calls=False),
        sampling=pb.SamplingParams(temperature=0.8, max_tokens=120))
    for seed in range(3):
        request.sampling.seed = seed
        with InferenceClient(generic_server.target) as c:
            responses = list(c.stub.Generate(request))
        deltas = [d for r in responses for d in r.tool_calls]
        assert deltas[0].name == "get_weather" and deltas[0].id.startswith("call_")
        jsonschema.validate(json.loads("".join(d.arguments for d in deltas)), WEATHER)
        assert responses[-1].finish_reason == "tool_calls" and not "".join(r.text for r in responses)
    # History with a call and its result, named function choice.
    request.messages.messages.extend([
        pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="c1", name="get_weather",
                                                                 arguments='{"city": "Oslo", "days": 2}')]),
        pb.ChatMessage(role="tool", tool_call_id="c1", content="Snow")])
    request.messages.tool_choice, request.messages.tool_choice_function = "", "get_weather"
    with InferenceClient(generic_server.target) as c:
        responses = list(c.stub.Generate(request))
        assert responses[-1].finish_reason == "tool_calls"
        bad = pb.GenerateRequest(messages=pb.Messages(messages=[pb.ChatMessage(role="user", content="x")],
                                                      tools=[pb.FunctionTool(name="f")], tool_choice_function="g"))
        with pytest.raises(Exception, match="messages.tool_choice"):
            list(c.stub.Generate(bad))
        stopped = pb.GenerateRequest()
        stopped.CopyFrom(request)
        stopped.sampling.stop.append(",")
        with pytest.raises(grpc.RpcError) as info:
            list(c.stub.Generate(stopped))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("sampling.stop:"), info.value.details()
        bad_schema = pb.GenerateRequest(messages=pb.Messages(
            messages=[pb.ChatMessage(role="user", content="x")], tool_choice="required",
            tools=[pb.FunctionTool(name="f", parameters=json.dumps({"type": "objekt"}))]))
        with pytest.raises(grpc.RpcError) as info:
            list(c.stub.Generate(bad_schema))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("messages.tools[0].parameters:"), info.value.details()
        bad_schema.messages.tools[0].parameters = json.dumps({"type": "object", "properties": {"p": {"type": "strin"}}})
        with pytest.raises(grpc.RpcError) as info:  # the grammar compiler's refusal
            list(c.stub.Generate(bad_schema))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("messages.tools:"), info.value.details()
