"""A real agent framework against the server: the OpenAI Agents SDK runs an agent with a
function tool through its chat-completions model and its Responses model, completing the tool
loop (the model calls the tool, the SDK runs it and sends the result back, the model answers).
Local only: the SDK's clients point at the server and tracing export is off."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Literal

import openai
import pydantic
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

from engine import EngineConfig
from tests.server_harness import ServerThread

EOS = 2  # <|im_end|> in the tiny model's tokenizer


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerThread]:
    srv = ServerThread(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=512, block_size=4), http_port=0,
                       served_model_name="tiny")
    assert srv.engine.tokenizer.convert_tokens_to_ids("<|im_end|>") == EOS
    yield srv
    srv.stop()


def _run_agent(server: ServerThread, api: str, settings: ModelSettings) -> tuple[object, list[str]]:
    """The forecaster agent's run through the api's model: its result and the cities its tool got."""
    set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Tokyo", "Lima"], days: Annotated[int, pydantic.Field(ge=1, le=14)]) -> str:
        """The weather forecast of a city."""
        cities.append(city)
        return f"Sunny in {city} for {days} days"

    async def run() -> object:
        client = openai.AsyncOpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=300)
        model = OpenAIChatCompletionsModel("tiny", client) if api == "chat_completions" else \
            OpenAIResponsesModel("tiny", client)
        agent = Agent(name="forecaster", instructions="Answer with the forecast.", tools=[get_weather], model=model,
                      model_settings=settings)
        try:
            return await Runner.run(agent, "What is the weather in Paris for two days?", max_turns=4)
        finally:
            await client.close()

    return asyncio.run(run()), cities


def _check_tool_loop(result: object, cities: list[str]) -> None:
    assert cities and set(cities) <= {"Paris", "Tokyo", "Lima"}  # the tool ran with valid arguments
    outputs = [item.output for item in result.new_items if item.type == "tool_call_output_item"]
    assert all(str(o).startswith("Sunny in ") for o in outputs), outputs  # never a call that did not parse
    kinds = [item.type for item in result.new_items]
    assert kinds[0] == "tool_call_item" and "tool_call_output_item" in kinds, kinds
    assert kinds[-1] == "message_output_item", kinds
    assert isinstance(result.final_output, str) and result.final_output
    assert len(result.raw_responses) == 2  # the call(s), then the answer


@pytest.mark.parametrize("parallel", [False, None])
@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_agent_completes_its_tool_loop(server: ServerThread, api: str, parallel: bool | None) -> None:
    # The first turn must call the tool (the tiny model would not choose to); the SDK then
    # resets tool_choice to auto, and the model answers in text, steered to end it before
    # max_tokens (the SDK's Responses model takes an incomplete response as a failure).
    # parallel None: the server's default (parallel calls allowed).
    settings = ModelSettings(tool_choice="required", temperature=0.8, max_tokens=120, parallel_tool_calls=parallel,
                             extra_body={"seed": 4, "logit_bias": {str(EOS): 16}})
    _check_tool_loop(*_run_agent(server, api, settings))


@pytest.fixture(scope="module")
def real_server() -> Iterator[ServerThread]:
    srv = ServerThread(EngineConfig(num_kv_blocks=512), http_port=0, served_model_name="tiny")
    assert srv.engine.tokenizer.convert_tokens_to_ids("<|im_end|>") == EOS
    yield srv
    srv.stop()


@pytest.mark.real_model
@pytest.mark.parametrize("seed", [5, 7])
@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_real_model_agent_with_parallel_calls_finishes(real_server: ServerThread, api: str, seed: int) -> None:
    """The default model (SmolLM2-135M-Instruct) sampled at 0.8 with parallel calls allowed
    repeats its call (with these seeds): the repeat ends the calls (tool_calls, the response
    completed, where it used to run on to max_tokens: an incomplete response, which the SDK's
    Responses model raises on, and a cut call the chat model's tool failed on), so the agent runs
    to its final answer."""
    settings = ModelSettings(tool_choice="required", temperature=0.8, max_tokens=100, extra_body={"seed": seed})
    _check_tool_loop(*_run_agent(real_server, api, settings))
