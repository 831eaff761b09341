"""Real chat templates (llama.cpp's copies of the models' own, read from llama-cpp-python's sdist,
never committed here) on tiny random models, through the HTTP server and the official openai
SDK: the tool-call and reasoning parsers the server picks from a template when it is not told,
Qwen3's tools and <think> block (enable_thinking on and off), and Gemma's template, which has
no system role and no tools section.

The sdist has no Gemma 3 template (llama.cpp ships Gemma 2's and Gemma 4's); Gemma 2's is the one
read here: a system message is the template's to refuse (as vLLM leaves it), and the tools block
of the generic format goes into the first user turn, never into a system message it would refuse.
Gemma 3's way, a system message folded into the first user turn, is checked on FOLDING_TEMPLATE,
written here to that behaviour (not Google's text).
"""
from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from engine import EngineConfig
from engine.processing.input_processor import InputProcessor
from service.chat.template_traits import read_template_traits
from service.chat.tool_parsers import parser_for_template
from service.chat.tools import ChatTools
from tests.llama_cpp_sdist import chat_template
from tests.server_harness import ServerThread
from tests.service.tool_cases import ANSWER, ASK, TOOLS, check_calls, reassemble, start_server, whole_answer
from tests.tiny_model import GEMMA_TOKENS, QWEN_TOKENS, build_tiny_model, build_tiny_tokenizer

QWEN3 = "Qwen-Qwen3-0.6B"
GEMMA = "google-gemma-2-2b-it"
JSON_ANSWER = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}
# Gemma's turns with no system turn of their own: a system message's text opens the first user
# turn (Gemma 3's behaviour); roles must alternate, as Gemma's templates demand.
FOLDING_TEMPLATE = (
    "{{ bos_token }}{% set lead = namespace(text='') %}{% set turns = messages %}"
    "{% if messages[0]['role'] == 'system' %}{% set lead.text = messages[0]['content'] ~ '\n\n' %}"
    "{% set turns = messages[1:] %}{% endif %}"
    "{% for m in turns %}{% if (m['role'] == 'user') != (loop.index0 is even) %}"
    "{{ raise_exception('user and model turns must alternate') }}{% endif %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if loop.first %}{{ lead.text }}{% endif %}{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


class _TemplateEngine:
    """What read_template_traits asks of an AsyncEngine, on a tokenizer alone: the engine's own
    InputProcessor renders the chat (a template's refusal is its FieldError)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.inputs = InputProcessor(tokenizer, len(tokenizer), 4096, EngineConfig())

    def tokenizer_info(self) -> dict[str, Any]:
        return {"chat_template": self.tokenizer.chat_template}

    async def tokenize(self, messages: list[dict[str, Any]],
                       chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        return self.inputs.apply_chat_template(messages, None, chat_template_kwargs)

    async def detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)


# template -> (tool-call format, reasoning parser without enable_thinking, with it true, knows
# tools, has a system role)
_AUTO = {
    QWEN3: ("hermes", "qwen3", "qwen3", True, True),
    # llama.cpp's copies close the block in the prompt unless thinking is asked for
    "Qwen-QwQ-32B": ("hermes", "qwen3", "deepseek_r1", True, True),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": ("hermes", "qwen3", "deepseek_r1", False, True),
    "Qwen-Qwen2.5-7B-Instruct": ("hermes", None, None, True, True),
    "meta-llama-Llama-3.1-8B-Instruct": ("llama3_json", None, None, True, True),
    "mistralai-Mistral-Nemo-Instruct-2407": ("mistral", None, None, True, True),
    GEMMA: ("hermes", None, None, False, False),  # the generic format; a system message is refused
}


@pytest.mark.parametrize("name", sorted(_AUTO))
def test_parsers_are_chosen_from_the_template(name: str, tmp_path: Path) -> None:
    """Unset (auto), the server reads the formats off the template: its call markers, whether it
    writes <think> blocks, and whether its generation prompt already opens one (with the
    request's enable_thinking: a prompt that opens the block needs deepseek_r1, one that leaves it
    to the answer qwen3, and enable_thinking false none at all)."""
    template = chat_template(name)
    tokens = GEMMA_TOKENS if "gemma" in name else QWEN_TOKENS
    engine = _TemplateEngine(build_tiny_tokenizer(tmp_path / "tok", template, tokens))
    traits = asyncio.run(read_template_traits(engine))
    tool_format, by_default, when_asked, knows_tools, has_system = _AUTO[name]
    assert parser_for_template(template) == tool_format
    assert (traits.knows_tools, traits.has_system_role) == (knows_tools, has_system)
    auto = ChatTools()
    for enable_thinking, expected in ((None, by_default), (True, when_asked), (False, None)):
        assert traits.reasoning_parser(enable_thinking) == expected
        chosen = auto.reasoning_for(traits, enable_thinking)
        assert (chosen.name if chosen else None) == expected
    assert ChatTools(reasoning_parser="none").reasoning_for(traits) is None  # told: off
    told = ChatTools(reasoning_parser="deepseek_r1")
    assert told.reasoning_for(traits).name == "deepseek_r1" and told.reasoning_for(traits, False) is None


def test_unknown_reasoning_parser_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="reasoning_parser"):
        ChatTools(reasoning_parser="qwen4")


@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """A tiny Llama with Qwen3's template and tokens; the server is told neither parser."""
    model = build_tiny_model(tmp_path_factory.mktemp("qwen3") / "model", chat_template=chat_template(QWEN3),
                             tokens=QWEN_TOKENS)
    srv = start_server(model)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def gemma_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    model = build_tiny_model(tmp_path_factory.mktemp("gemma") / "model", chat_template=chat_template(GEMMA),
                             tokens=GEMMA_TOKENS)
    srv = start_server(model)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def folding_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    model = build_tiny_model(tmp_path_factory.mktemp("fold") / "model", chat_template=FOLDING_TEMPLATE,
                             tokens=GEMMA_TOKENS)
    srv = start_server(model)
    yield srv
    srv.stop()


def _client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key="x", max_retries=0, timeout=120)


def _ids(server: ServerThread, *tokens: str) -> list[int]:
    return [server.engine.tokenizer.convert_tokens_to_ids(t) for t in tokens]


def _prompt(server: ServerThread, messages: list[dict], **fields: Any) -> str:
    """The prompt a chat with these fields gets, by vLLM's /tokenize (tools and template
    variables included), as text."""
    request = urllib.request.Request(server.http_url + "/tokenize", headers={"content-type": "application/json"},
                                     data=json.dumps({"model": "tiny", "messages": messages, **fields}).encode())
    with urllib.request.urlopen(request, timeout=60) as resp:
        return server.engine.tokenizer.decode(json.loads(resp.read())["tokens"])


def _both(client: openai.OpenAI, **request: Any) -> tuple[Any, dict]:
    """The whole answer and its streamed twin (same seed), reassembled."""
    whole = client.chat.completions.create(model="tiny", **request)
    chunks = list(client.chat.completions.create(model="tiny", stream=True, **request))
    return whole, reassemble(chunks)


def test_qwen3_chat(qwen3_server: ServerThread) -> None:
    """A plain chat: Qwen3's ChatML turns, an answer whose stream adds up to it."""
    messages = [{"role": "system", "content": "Be brief."}, *ASK]
    prompt = _prompt(qwen3_server, messages)
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    assert prompt.endswith("<|im_start|>assistant\n")
    with _client(qwen3_server) as client:
        whole, streamed = _both(client, messages=messages, temperature=0.8, seed=1, max_tokens=20,
                                logit_bias={str(_ids(qwen3_server, "<think>")[0]): -100})
    choice = whole.choices[0]
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    assert streamed == whole_answer(choice.message, choice.finish_reason)


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_qwen3_tool_call_parses(qwen3_server: ServerThread, choice: str) -> None:
    """Tools go to Qwen3's own template (its # Tools system block), calls are read as Hermes'
    <tool_call> JSON, and the grammar makes them parse: required, or auto steered toward
    <tool_call>. Thinking off (enable_thinking false), so the call is the answer's start."""
    prompt = _prompt(qwen3_server, ASK, tools=TOOLS)
    assert prompt.startswith("<|im_start|>system\n# Tools\n") and '"name": "get_weather"' in prompt
    tool_call, think = _ids(qwen3_server, "<tool_call>", "<think>")
    with _client(qwen3_server) as client:
        for seed in range(2):
            whole, streamed = _both(client, messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                                    temperature=0.8, seed=seed, max_tokens=150,
                                    logit_bias={str(tool_call): 12, str(think): -100},
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            out = whole.choices[0]
            assert out.finish_reason == "tool_calls" and len(out.message.tool_calls) == 1, out
            check_calls(out.message.tool_calls)
            assert "<tool_call>" not in (out.message.content or "") and getattr(out.message, "reasoning_content", None) is None
            assert streamed == whole_answer(out.message, "tool_calls")


def test_qwen3_thinking_turn_is_reasoning(qwen3_server: ServerThread) -> None:
    """enable_thinking true (Qwen3's default): the prompt leaves the block to the answer; an answer
    that opens <think> has its block in reasoning_content, the call (or JSON answer) after it
    parses, and usage counts the block's tokens."""
    prompt = _prompt(qwen3_server, ASK, chat_template_kwargs={"enable_thinking": True})
    assert prompt.endswith("<|im_start|>assistant\n")
    think, end_think, tool_call = _ids(qwen3_server, "<think>", "</think>", "<tool_call>")
    bias = {str(think): 30, str(end_think): 12, str(tool_call): 12}
    num_thought = 0
    with _client(qwen3_server) as client:
        for seed in range(3):
            whole, streamed = _both(client, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0.8,
                                    parallel_tool_calls=False, seed=seed, max_tokens=200, logit_bias=bias,
                                    extra_body={"chat_template_kwargs": {"enable_thinking": True}})
            out = whole.choices[0]
            assert out.finish_reason == "tool_calls" and out.message.content is None, out
            check_calls(out.message.tool_calls)
            assert "<think>" not in (out.message.reasoning_content or "")
            assert "</think>" not in (out.message.reasoning_content or "")
            num_thought += bool(out.message.reasoning_content)
            assert (whole.usage.completion_tokens_details.reasoning_tokens > 0) == bool(out.message.reasoning_content)
            assert streamed == whole_answer(out.message, "tool_calls")
            whole, streamed = _both(client, messages=ASK, temperature=0.8, seed=seed, max_tokens=200,
                                    logit_bias={str(think): 30, str(end_think): 12}, response_format=JSON_ANSWER)
            out = whole.choices[0]
            assert out.message.reasoning_content and "<think>" not in out.message.content, out
            jsonschema.validate(json.loads(out.message.content), ANSWER)
            assert streamed == whole_answer(out.message, out.finish_reason)
    assert num_thought >= 2


def test_qwen3_thinking_off_has_the_empty_block_and_no_reasoning(qwen3_server: ServerThread) -> None:
    """enable_thinking false: the template closes an empty block in the prompt, and nothing in
    the answer is reasoning, not even a <think> the model writes (it stays content)."""
    prompt = _prompt(qwen3_server, ASK, chat_template_kwargs={"enable_thinking": False})
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    think, end_think = _ids(qwen3_server, "<think>", "</think>")
    with _client(qwen3_server) as client:
        for seed in range(2):
            whole, streamed = _both(client, messages=ASK, temperature=0.8, seed=seed, max_tokens=20,
                                    logit_bias={str(think): 30, str(end_think): 10},
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            out = whole.choices[0]
            assert getattr(out.message, "reasoning_content", None) is None and out.message.content.startswith("<think>"), out
            details = whole.usage.completion_tokens_details
            assert details is None or not details.reasoning_tokens
            assert streamed == whole_answer(out.message, out.finish_reason)


def test_qwen3_multi_turn_with_a_call_its_thinking_and_a_result(qwen3_server: ServerThread) -> None:
    """The assistant's call (content null, as OpenAI sends it) and its earlier thinking go back
    through Qwen3's template: the call as <tool_call>, the thinking replayed (after the last
    query), the result as <tool_response>; the next answer's call parses."""
    arguments = json.dumps({"city": "Paris", "days": 3})
    messages = [*ASK, {"role": "assistant", "content": None, "reasoning_content": "Use the tool.",
                       "tool_calls": [{"id": "call_1", "type": "function",
                                       "function": {"name": "get_weather", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    prompt = _prompt(qwen3_server, messages, tools=TOOLS)
    assert "<think>\nUse the tool.\n</think>\n\n<tool_call>\n" in prompt
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}' in prompt
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in prompt
    with _client(qwen3_server) as client:
        out = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="required",
                                             parallel_tool_calls=False, temperature=0.8, seed=0, max_tokens=150,
                                             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert out.choices[0].finish_reason == "tool_calls"
    check_calls(out.choices[0].message.tool_calls)


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"enable_thinking": "false"}, "chat_template_kwargs.enable_thinking"),
    ({"tools": []}, "chat_template_kwargs.tools"),
    ({"add_generation_prompt": False}, "chat_template_kwargs"),
])
def test_bad_chat_template_kwargs_name_the_field(qwen3_server: ServerThread, kwargs: dict, param: str) -> None:
    with _client(qwen3_server) as client, pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=5,
                                       extra_body={"chat_template_kwargs": kwargs})
    assert info.value.body["param"] == param, info.value.body


def test_responses_reasoning_effort_none_turns_thinking_off(qwen3_server: ServerThread) -> None:
    """/v1/responses: reasoning.effort "none" is enable_thinking false (no reasoning item, a
    <think> the model writes is text); another effort keeps thinking (a reasoning item); an
    effort that contradicts chat_template_kwargs is refused naming it."""
    think, end_think = _ids(qwen3_server, "<think>", "</think>")
    bias = {str(think): 30, str(end_think): 10}
    with _client(qwen3_server) as client:
        off = client.responses.create(model="tiny", input="Hi", reasoning={"effort": "none"}, max_output_tokens=20,
                                      temperature=0.8, extra_body={"seed": 0, "logit_bias": bias})
        assert [item.type for item in off.output] == ["message"] and off.output_text.startswith("<think>")
        assert off.reasoning.effort == "none"
        on = client.responses.create(model="tiny", input="Hi", reasoning={"effort": "low"}, max_output_tokens=40,
                                     temperature=0.8, extra_body={"seed": 0, "logit_bias": bias})
        assert on.output[0].type == "reasoning" and on.usage.output_tokens_details.reasoning_tokens > 0
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model="tiny", input="Hi", reasoning={"effort": "high"}, max_output_tokens=5,
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert info.value.body["param"] == "reasoning.effort", info.value.body


def test_gemma_chat_and_its_system_role(gemma_server: ServerThread) -> None:
    """Gemma's turns (user / model, <bos> from the template, <end_of_turn> ends the answer); a
    system message is the template's to refuse, and the 400 says so."""
    prompt = _prompt(gemma_server, ASK)
    assert prompt == f"<bos><start_of_turn>user\n{ASK[0]['content']}<end_of_turn>\n<start_of_turn>model\n"
    end_of_turn = _ids(gemma_server, "<end_of_turn>")[0]
    with _client(gemma_server) as client:
        whole, streamed = _both(client, messages=ASK, temperature=0.8, seed=0, max_tokens=30,
                                logit_bias={str(end_of_turn): 12})
        out = whole.choices[0]
        assert out.finish_reason == "stop" and "<end_of_turn>" not in (out.message.content or ""), out
        assert streamed == whole_answer(out.message, "stop")
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "Be brief."}, *ASK],
                                           max_tokens=5)
    assert info.value.body["param"] == "messages" and "System role not supported" in info.value.body["message"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_gemma_tools_use_the_generic_format_in_the_user_turn(gemma_server: ServerThread, choice: Any) -> None:
    """Gemma's template knows no tools: the generic format lists them at the start of the first
    user turn (its template has no system turn to hold them), calls parse (required or a named
    function), and a call and its result go back as model and user turns."""
    prompt = _prompt(gemma_server, ASK, tools=TOOLS)
    assert prompt.startswith("<bos><start_of_turn>user\n# Tools\n") and "<tools>\n" in prompt
    assert prompt.endswith(f"{ASK[0]['content']}<end_of_turn>\n<start_of_turn>model\n")
    with _client(gemma_server) as client:
        whole, streamed = _both(client, messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                                temperature=0.8, seed=0, max_tokens=200)
        out = whole.choices[0]
        assert out.finish_reason == "tool_calls" and len(out.message.tool_calls) == 1, out
        check_calls(out.message.tool_calls)
        assert streamed == whole_answer(out.message, "tool_calls")
        call = out.message.tool_calls[0]
        messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        prompt = _prompt(gemma_server, messages, tools=TOOLS)
        assert f"<start_of_turn>model\n<tool_call>\n{{\"name\": \"{call.function.name}\"" in prompt
        assert "<start_of_turn>user\n<tool_response>\nsunny\n</tool_response><end_of_turn>\n" in prompt
        again = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, temperature=0.8, seed=1, max_tokens=200)
    assert again.choices[0].finish_reason == "tool_calls"
    check_calls(again.choices[0].message.tool_calls)


def test_a_folded_system_message_and_tools(folding_server: ServerThread) -> None:
    """A template that folds a system message into the first user turn (Gemma 3's way) gets the
    client's system message as it is, and the generic tools block after it, in that same turn;
    the chat is served and the call parses."""
    messages = [{"role": "system", "content": "Be brief."}, *ASK]
    assert _prompt(folding_server, messages) == (f"<bos><start_of_turn>user\nBe brief.\n\n{ASK[0]['content']}"
                                                 "<end_of_turn>\n<start_of_turn>model\n")
    prompt = _prompt(folding_server, messages, tools=TOOLS)
    assert prompt.startswith("<bos><start_of_turn>user\nBe brief.\n\n# Tools\n") and "<start_of_turn>system" not in prompt
    assert prompt.endswith(f"</tool_call>\nThe results come back in <tool_response> tags. If no function helps, just "
                           f"answer.\n\n{ASK[0]['content']}<end_of_turn>\n<start_of_turn>model\n")
    with _client(folding_server) as client:
        out = client.chat.completions.create(model="tiny", messages=messages, temperature=0.8, seed=0, max_tokens=10)
        assert out.choices[0].message.content
        whole, streamed = _both(client, messages=messages, tools=TOOLS, tool_choice="required",
                                parallel_tool_calls=False, temperature=0.8, seed=0, max_tokens=200)
    check_calls(whole.choices[0].message.tool_calls)
    assert streamed == whole_answer(whole.choices[0].message, "tool_calls")


def test_grpc_chat_template_kwargs(qwen3_server: ServerThread) -> None:
    """gRPC's Messages.chat_template_kwargs (JSON text) reach the template and the reasoning
    parser as on HTTP: thinking by default, none with enable_thinking false; bad ones are
    INVALID_ARGUMENT naming the field."""
    import grpc

    from service.grpc.minivllm_client import InferenceClient
    from service.pb import inference_pb2 as pb

    think, end_think = _ids(qwen3_server, "<think>", "</think>")

    def request(kwargs: str) -> pb.GenerateRequest:
        return pb.GenerateRequest(
            messages=pb.Messages(messages=[pb.ChatMessage(role="user", content="2+2?")], chat_template_kwargs=kwargs),
            sampling=pb.SamplingParams(temperature=0.8, seed=0, max_tokens=30, logit_bias={think: 30, end_think: 10}))

    with InferenceClient(qwen3_server.target) as c:
        thinking = list(c.stub.Generate(request("")))
        off = list(c.stub.Generate(request('{"enable_thinking": false}')))
        errors = []
        for kwargs in ('{"enable_thinking": "no"}', "[1]", "{"):
            with pytest.raises(grpc.RpcError) as info:
                list(c.stub.Generate(request(kwargs)))
            errors.append((info.value.code(), info.value.details()))
    assert "".join(r.reasoning_text for r in thinking) and thinking[-1].usage.reasoning_tokens > 0
    assert not "".join(r.reasoning_text for r in off) and "<think>" in "".join(r.text for r in off)
    assert off[-1].usage.reasoning_tokens == 0
    for code, details in errors:
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "messages.chat_template_kwargs" in details, details


def test_responses_replay_reasoning_items_to_the_template(qwen3_server: ServerThread) -> None:
    """A reasoning item goes back as the reasoning_content of the assistant turn it opens (its
    calls or its message join it), which Qwen3's template shows after the last query: the same
    input with the item makes exactly the thought's tokens more, as /tokenize renders it."""
    from service.openai.responses_protocol import input_messages

    thought = {"type": "reasoning", "id": "rs_1", "summary": [],
               "content": [{"type": "reasoning_text", "text": "Use the tool."}]}
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
            "arguments": json.dumps({"city": "Paris", "days": 3})}
    result = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
    items = [{"role": "user", "content": ASK[0]["content"]}, thought, call, result]
    messages = input_messages(items)
    assert messages[1] == {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
                           "tool_calls": [{"id": "call_1", "type": "function",
                                           "function": {"name": "get_weather", "arguments": call["arguments"]}}]}
    said = input_messages([items[0], thought, {"type": "message", "role": "assistant", "content": "Sunny."}])
    assert said[1] == {"role": "assistant", "content": "Sunny.", "reasoning_content": "Use the tool."}
    with pytest.raises(ValueError, match=r"input\[1\]\.content"):
        input_messages([items[0], {"type": "reasoning", "content": "not parts"}])
    prompt = _prompt(qwen3_server, messages, tools=TOOLS)
    assert "<|im_start|>assistant\n<think>\nUse the tool.\n</think>\n\n<tool_call>" in prompt
    with _client(qwen3_server) as client:
        usage = [client.responses.create(model="tiny", input=with_or_without, tools=[
            {"type": "function", **TOOLS[0]["function"]}], max_output_tokens=5, temperature=0).usage.input_tokens
            for with_or_without in (items, [items[0], call, result])]
    num_thought = len(qwen3_server.engine.tokenizer.encode("<think>\nUse the tool.\n</think>\n\n",
                                                           add_special_tokens=False))
    assert usage[0] - usage[1] == num_thought, usage
