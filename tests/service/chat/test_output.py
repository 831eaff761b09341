"""One answer's parse (ChoiceOutput) under the rules of docs/openai_tools.md: calls go out whole,
a cut call is content, a repeated call ends the calls; the same text fed whole, cut at every
character and one character at a time gives the same answer and finish reason."""
from __future__ import annotations

import json

import pytest

from service.chat.output import ChoiceOutput
from service.chat.tool_parsers import get_tool_parser

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
SAME_WEATHER = '{"name": "get_weather", "arguments": {"days": 3,  "city": "Paris"}}'  # same call, other layout
TIME = '{"name": "get_time", "arguments": {"tz": "UTC"}}'


def _hermes(*calls: str) -> str:
    return "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls)


def _answer(pieces: list[str], engine_reason: str,
            fmt: str = "hermes") -> tuple[str | None, list[tuple[str, str]], str | None, list[list[str]]]:
    """content, [(name, arguments)], finish reason, and per delta the calls' argument texts sent."""
    output = ChoiceOutput(None, get_tool_parser(fmt))
    sent = []
    for i, piece in enumerate(pieces):
        delta = output.feed_text(piece, is_final=i == len(pieces) - 1)
        for call in delta.parsed.calls:
            assert call.id is not None and call.name, "a call goes out in one piece, name first"
            sent.append(call.arguments)
    message = output.message()
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    return message["content"], calls, output.finish_reason(engine_reason), sent


# (text, the engine's finish reason, content, calls, finish reason)
CASES = [
    (_hermes(WEATHER, TIME), "stop", None, [("get_weather", '{"city": "Paris", "days": 3}'),
                                            ("get_time", '{"tz": "UTC"}')], "tool_calls"),
    # max_tokens inside the second call: the first stays a call, the cut one is content.
    (_hermes(WEATHER) + '\n<tool_call>\n{"name": "get_time", "argu', "length",
     '<tool_call>\n{"name": "get_time", "argu', [("get_weather", '{"city": "Paris", "days": 3}')], "length"),
    # inside the only call, before and after its name.
    ('Let me see. <tool_call>\n{"na', "length", 'Let me see. <tool_call>\n{"na', [], "length"),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', "length",
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', [], "length"),
    # a stop string inside a call: the same rule, finish reason stop.
    (_hermes(TIME) + '\n<tool_call>\n{"name": "get_weather"', "stop", '<tool_call>\n{"name": "get_weather"',
     [("get_time", '{"tz": "UTC"}')], "stop"),
    # a repeat ends the calls, whatever followed it and however the engine then stopped.
    (_hermes(WEATHER, TIME, SAME_WEATHER, TIME) + "\nmore text", "stop", None,
     [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", '{"tz": "UTC"}')], "tool_calls"),
    (_hermes(TIME, TIME, TIME) + '\n<tool_call>\n{"name": "get_ti', "length", None, [("get_time", '{"tz": "UTC"}')],
     "tool_calls"),
    ("Sure." + _hermes(TIME, TIME), "abort", "Sure.", [("get_time", '{"tz": "UTC"}')], "tool_calls"),
    # the same function with other arguments is no repeat.
    (_hermes(WEATHER, WEATHER.replace("Paris", "Lima")), "stop", None,
     [("get_weather", '{"city": "Paris", "days": 3}'), ("get_weather", '{"city": "Lima", "days": 3}')], "tool_calls"),
]


@pytest.mark.parametrize(("text", "engine_reason", "content", "calls", "finish"), CASES,
                         ids=[str(i) for i in range(len(CASES))])
def test_whole_calls_cut_calls_and_repeats(text: str, engine_reason: str, content: str | None,
                                           calls: list[tuple[str, str]], finish: str) -> None:
    whole = _answer([text], engine_reason)
    assert whole[:3] == (content, calls, finish)
    for _, arguments in whole[1]:
        json.loads(arguments)  # every call returned parses
    for cut in range(len(text) + 1):
        assert _answer([text[:cut], text[cut:]], engine_reason)[:3] == whole[:3], cut
    by_char = _answer(list(text) + [""], engine_reason)
    assert by_char[:3] == whole[:3]
    assert by_char[3] == [arguments for _, arguments in calls]  # each call sent whole, once


@pytest.mark.parametrize(("fmt", "text", "calls"), [
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}, '
                '{"name": "a", "arguments": {"x": 1}}, {"name": "c", "arguments": {}}]', [("a", '{"x": 1}'), ("b", "{}")]),
    ("llama3_json", '{"name": "f", "parameters": {"q": 1}}; {"name": "f", "parameters": {"q": 1}}', [("f", '{"q": 1}')]),
])
def test_repeats_end_the_calls_in_every_format(fmt: str, text: str, calls: list[tuple[str, str]]) -> None:
    for pieces in ([text], list(text) + [""]):
        assert _answer(pieces, "length", fmt)[1:3] == (calls, "tool_calls")


def test_a_repeat_asks_the_engine_to_stop_the_sample_once() -> None:
    from engine import RequestOutput

    stopped: list[tuple[str, int]] = []
    output = ChoiceOutput(None, get_tool_parser("hermes"), stop_sample=lambda rid, i: stopped.append((rid, i)))

    def out(text: str, finished: bool = False) -> RequestOutput:
        return RequestOutput(request_id="r#1", prompt_token_ids=[], token_ids=[], text="", new_token_ids=[1],
                             new_text=text, finish_reason="stop" if finished else None, index=2)

    output.feed(out(_hermes(TIME) + "\n"))
    assert stopped == []
    output.feed(out(_hermes(TIME)))
    assert stopped == [("r#1", 2)]
    assert not output.feed(out(_hermes(WEATHER)))  # generated before the stop took effect: dropped
    output.feed(out("", finished=True))
    assert stopped == [("r#1", 2)] and output.finish_reason("stop") == "tool_calls"
    assert len(output.message()["tool_calls"]) == 1
