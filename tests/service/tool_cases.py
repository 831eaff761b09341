"""The tools the tool-calling tests ask for, and how they check and reassemble an answer
(shared by the chat, Responses, reasoning and grammar tests)."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema

from engine import EngineConfig
from tests.server_harness import ServerThread

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "minimum": 1,
                                                                                "maximum": 7}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["tz"],
        "properties": {"tz": {"enum": ["UTC", "CET", "JST"]}, "24h": {"type": "boolean"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
THINK, END_THINK = 505, 506  # <think>, </think> in the tool model's tokenizer
TOOL_CALL_TOKEN = 503  # <tool_call> in the tool model's tokenizer (the tool_server fixture checks it)


def start_server(model_dir: Path, **options: object) -> ServerThread:
    return ServerThread(EngineConfig(model=str(model_dir), num_kv_blocks=512, block_size=4), http_port=0,
                        served_model_name="tiny", **options)


def check_calls(calls: list) -> None:
    """Every call's arguments parse as JSON and validate against its function's schema."""
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"


def reassemble(chunks: list) -> dict:
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or []:
            if call.id is not None:
                assert call.index not in calls and call.function.name  # the name comes first, once
                calls[call.index] = [call.function.name, ""]
            calls[call.index][1] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return {"content": content or None, "reasoning": reasoning or None, "calls": list(calls.values()) or None,
            "finish": finish}


def whole_answer(message: object, finish: str) -> dict:
    calls = [[c.function.name, c.function.arguments] for c in message.tool_calls or []] or None
    return {"content": message.content or None, "reasoning": getattr(message, "reasoning_content", None) or None,
            "calls": calls, "finish": finish}


# The reasoning tests' constrained answer after a thinking block.
ANSWER = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["answer"], "additionalProperties": False}
