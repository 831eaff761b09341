"""What the Harmony tests (tests/service/chat/test_harmony.py, tests/service/openai/test_harmony_api.py)
share: a date, two functions, a scripted gpt-oss answer, and the byte-level spelling of o200k's tokens."""
from __future__ import annotations

from service.chat.harmony_vocab import byte_level_decoder
from service.chat.tool_grammar import FunctionSpec

DATE = "2026-12-05"
NUM_ORDINARY_TOKENS = 199_998  # o200k's ranked tokens; Harmony's special tokens come after
WEATHER = FunctionSpec("get_weather", "The weather in a city", {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
TIME = FunctionSpec("get_time", "The time now", None)
ANSWER = ('<|channel|>analysis<|message|>The user wants the weather; call the tool.<|end|>'
          '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
          '{"city": "Paris"}<|call|>'
          '<|start|>assistant<|channel|>final<|message|>It is sunny in Paris, 21 °C.<|return|>')


def byte_level(tokens: list[bytes]) -> list[str]:
    encoder = {b: c for c, b in byte_level_decoder().items()}
    return ["".join(encoder[b] for b in token) for token in tokens]
