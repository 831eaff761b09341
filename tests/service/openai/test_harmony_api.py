"""gpt-oss's Harmony answers through the official `openai` SDK: a scripted answer (an analysis
message, a commentary call to functions.get_weather, a final message, as Harmony token ids)
comes back as reasoning, a valid call and content, streamed and whole, on /v1/chat/completions
and /v1/responses. The engine is a scripted test double (tests/service/scripted_engine.py); the
prompt it was handed is openai-harmony's rendering, and its stop tokens Harmony's."""
from __future__ import annotations

import datetime
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from service.chat.harmony import HarmonyFormat
from service.chat.tool_grammar import FunctionSpec
from tests.harmony_data import ANSWER, WEATHER
from tests.service.scripted_engine import ScriptedEngine, ScriptedServer

THOUGHT = "The user wants the weather; call the tool."
FINAL = "It is sunny in Paris, 21 °C."
CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": WEATHER.name, "description": WEATHER.description,
                                           "parameters": WEATHER.parameters}}]
RESPONSE_TOOLS = [{"type": "function", "name": WEATHER.name, "description": WEATHER.description,
                   "parameters": WEATHER.parameters}]


@pytest.fixture(scope="module")
def server(gpt_oss_dir: Path, harmony: HarmonyFormat,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScriptedServer]:
    cache = tmp_path_factory.mktemp("minivllm-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MINIVLLM_CACHE", str(cache))  # the server writes its vocabulary file here
        patch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
        ids = harmony.encoding.encode(ANSWER, allowed_special="all")
        engine = ScriptedEngine(gpt_oss_dir, ids, harmony.encoding.decode)
        srv = ScriptedServer(engine)
        yield srv
        srv.stop()
    assert (cache / "tiktoken" / "o200k_base.tiktoken").is_file()


def _client(server: ScriptedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _check_call(name: str, arguments: str) -> None:
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER.parameters)
    assert json.loads(arguments) == {"city": "Paris"}


def _check_admitted(server: ScriptedServer, harmony: HarmonyFormat, functions: list[FunctionSpec]) -> None:
    admitted = server.engine.admitted[-1]
    today = datetime.date.today().isoformat()
    assert admitted.messages is None and admitted.prompt == harmony.render(CHAT, functions, start_date=today)
    assert {200002, 200012} <= set(admitted.params.stop_token_ids)


def test_chat_completion_whole(server: ScriptedServer, harmony: HarmonyFormat) -> None:
    with _client(server) as client:
        out = client.chat.completions.create(model="gpt-oss-scripted", messages=CHAT, tools=TOOLS)
    _check_admitted(server, harmony, [WEATHER])
    [choice] = out.choices
    assert choice.message.model_extra["reasoning_content"] == THOUGHT
    assert choice.message.content == FINAL
    [call] = choice.message.tool_calls
    _check_call(call.function.name, call.function.arguments)
    assert choice.finish_reason == "tool_calls"
    assert out.usage.completion_tokens_details.reasoning_tokens > 0


def test_chat_completion_streamed(server: ScriptedServer) -> None:
    reasoning, content, calls, reasons = [], [], [], []
    with _client(server) as client:
        for chunk in client.chat.completions.create(model="gpt-oss-scripted", messages=CHAT, tools=TOOLS,
                                                    stream=True):
            for choice in chunk.choices:
                delta = choice.delta
                reasoning.append((delta.model_extra or {}).get("reasoning_content") or "")
                content.append(delta.content or "")
                calls += delta.tool_calls or []
                reasons.append(choice.finish_reason)
    assert "".join(reasoning) == THOUGHT and "".join(content) == FINAL
    [call] = calls
    assert call.id.startswith("call_") and call.index == 0
    _check_call(call.function.name, call.function.arguments)
    assert [r for r in reasons if r] == ["tool_calls"]


def test_chat_without_tools_renders_none(server: ScriptedServer, harmony: HarmonyFormat) -> None:
    with _client(server) as client:
        client.chat.completions.create(model="gpt-oss-scripted", messages=CHAT, max_tokens=5)
    _check_admitted(server, harmony, [])
    assert "namespace functions" not in harmony.encoding.decode(server.engine.admitted[-1].prompt)


def test_responses_whole(server: ScriptedServer) -> None:
    with _client(server) as client:
        out = client.responses.create(model="gpt-oss-scripted", instructions="Answer briefly.",
                                      input="Weather in Paris?", tools=RESPONSE_TOOLS)
    assert [item.type for item in out.output] == ["reasoning", "function_call", "message"]
    reasoning, call, message = out.output
    assert "".join(p.text for p in reasoning.content) == THOUGHT
    _check_call(call.name, call.arguments)
    assert out.output_text == FINAL
    assert out.usage.output_tokens_details.reasoning_tokens > 0


def test_responses_streamed(server: ScriptedServer) -> None:
    with _client(server) as client:
        events = list(client.responses.create(model="gpt-oss-scripted", instructions="Answer briefly.",
                                              input="Weather in Paris?", tools=RESPONSE_TOOLS, stream=True))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert thought == THOUGHT and text == FINAL
    [done] = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    _check_call(done.name, done.arguments)
    final = events[-1]
    assert final.type == "response.completed"
    assert [item.type for item in final.response.output] == ["reasoning", "function_call", "message"]


def test_tokenize_gives_the_harmony_prompt(server: ScriptedServer, harmony: HarmonyFormat) -> None:
    body = json.dumps({"messages": CHAT, "tools": TOOLS}).encode()
    request = urllib.request.Request(server.url + "/tokenize", body, {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        tokens = json.loads(response.read())["tokens"]
    today = datetime.date.today().isoformat()
    assert tokens == harmony.render(CHAT, [WEATHER], start_date=today)


def test_required_tool_choice_is_refused_by_name(server: ScriptedServer) -> None:
    with _client(server) as client, pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="gpt-oss-scripted", messages=CHAT, tools=TOOLS, tool_choice="required")
    assert info.value.body["param"] == "tool_choice"


def test_parser_options_choose_harmony(gpt_oss_dir: Path, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: Harmony for gpt-oss only; `harmony` for either parser: Harmony for any model; another
    format named outright: not Harmony, even for gpt-oss."""
    import asyncio

    from service.chat.tools import ChatTools

    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (other / "tokenizer.json").symlink_to(gpt_oss_dir / "tokenizer.json")
    llama, gpt_oss = ScriptedEngine(other, [], str), ScriptedEngine(gpt_oss_dir, [], str)

    def chosen(tools: ChatTools, engine: ScriptedEngine) -> bool:
        return asyncio.run(tools.harmony_format(engine)) is not None  # type: ignore[arg-type]

    assert not chosen(ChatTools(), llama) and chosen(ChatTools(), gpt_oss)
    assert chosen(ChatTools(tool_call_parser="harmony"), llama)
    assert chosen(ChatTools(reasoning_parser="harmony"), llama)
    assert not chosen(ChatTools(tool_call_parser="hermes"), gpt_oss)
    with pytest.raises(ValueError, match="tool_call_parser"):
        ChatTools(tool_call_parser="harmonics")


def test_a_gpt_oss_model_without_its_vocabulary_is_unavailable_for_chats(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A gpt-oss model whose tokenizer is not o200k's: chats are refused with 503 naming the
    vocabulary (never served with a wrong one, never downloaded)."""
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0}}}))
    srv = ScriptedServer(ScriptedEngine(tmp_path, [], str))
    try:
        with _client(srv) as client:
            for _ in range(2):  # the failure is remembered, and said again
                with pytest.raises(openai.APIStatusError) as info:
                    client.chat.completions.create(model="gpt-oss-scripted", messages=CHAT)
                assert info.value.status_code == 503 and "o200k vocabulary" in info.value.message
    finally:
        srv.stop()


def test_grpc_generate_parses_harmony(server: ScriptedServer, harmony: HarmonyFormat) -> None:
    from service.grpc.minivllm_client import InferenceClient
    from service.pb import inference_pb2 as pb

    request = pb.GenerateRequest(
        messages=pb.Messages(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in CHAT],
                             tools=[pb.FunctionTool(name=WEATHER.name, description=WEATHER.description,
                                                    parameters=json.dumps(WEATHER.parameters))]),
        sampling=pb.SamplingParams(max_tokens=500))
    with InferenceClient(server.grpc_target) as client:
        responses = list(client.stub.Generate(request))
    _check_admitted(server, harmony, [WEATHER])
    assert "".join(r.reasoning_text for r in responses) == THOUGHT
    assert "".join(r.text for r in responses) == FINAL
    [call] = [c for r in responses for c in r.tool_calls]
    _check_call(call.name, call.arguments)
    assert responses[-1].finish_reason == "tool_calls"


def test_grpc_tokenize_gives_what_grpc_generate_renders(server: ScriptedServer, harmony: HarmonyFormat) -> None:
    """Tokenize's chat ids are Generate's prompt: Harmony's rendering with the tools, not the template's."""
    from service.grpc.minivllm_client import InferenceClient
    from service.pb import inference_pb2 as pb

    messages = pb.Messages(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in CHAT],
                           tools=[pb.FunctionTool(name=WEATHER.name, description=WEATHER.description,
                                                  parameters=json.dumps(WEATHER.parameters))])
    with InferenceClient(server.grpc_target) as client:
        ids = list(client.stub.Tokenize(pb.TokenizeRequest(messages=messages)).token_ids)
    assert ids == harmony.render(CHAT, [WEATHER], start_date=datetime.date.today().isoformat())
