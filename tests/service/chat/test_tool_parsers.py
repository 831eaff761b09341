"""Tool-call parsers on each format's examples: the whole answer, and the same text streamed in
two pieces cut at every character and one character at a time, which must reassemble into it."""
from __future__ import annotations

import json
import re

import pytest

from service.chat.tool_parsers import TOOL_PARSERS, ParsedAnswer, get_tool_parser, parser_for_template

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TRICKY = '{"name": "echo", "arguments": {"s": "a \\"}\\" {[b <tool_call>", "n": -1.5e3, "ok": true, "z": null}}'

# Each format's call ids: Mistral's templates accept only 9 letters and digits.
CALL_IDS = {"hermes": r"call_[0-9a-f]{24}", "llama3_json": r"call_[0-9a-f]{24}", "mistral": r"[A-Za-z0-9]{9}"}

# (format, text, expected content, expected [(name, arguments)])
EXAMPLES = [
    ("hermes", f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>", "Let me check.",
     [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TRICKY}\n</tool_call>", "",
     [("get_weather", '{"city": "Paris", "unit": "celsius"}'),
      ("echo", '{"s": "a \\"}\\" {[b <tool_call>", "n": -1.5e3, "ok": true, "z": null}')]),
    ("hermes", "a < b, and <tool is not <tool_call", "a < b, and <tool is not <tool_call", []),
    ("hermes", '<tool_call>\n{"arguments": {"q": "x"}, "name": "search"}\n</tool_call>\nDone. ', "Done. ",
     [("search", '{"q": "x"}')]),
    ("hermes", "<tool_call>\nnot json</tool_call> after", "<tool_call>\nnot json</tool_call> after", []),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "", [("f", '{"a": 1}')]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": "unfinis', "", [("f", '{"a": "unfinis')]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"n": 12}}', "", [("f", '{"n": 12}')]),
    ("hermes", 'Hi <tool_call>\n{"na', "Hi", []),  # cut off before its name: no call, and no markup
    ("hermes", '<tool_call>\n{"name": "f", "type": "function", "parameters": {"n": 1}}\n</tool_call>', "",
     [("f", '{"n": 1}')]),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]', "Sure.",
     [("a", '{"x": 1}'), ("b", "{}")]),
    ("mistral", '[TOOL_CALLS]{"name": "a", "arguments": {"x": [1, {"y": "]"}]}}', "", [("a", '{"x": [1, {"y": "]"}]}')]),
    ("mistral", "[TOOL_CALLS] nope", "[TOOL_CALLS] nope", []),
    ("mistral", "no calls [TOOL", "no calls [TOOL", []),
    ("llama3_json", '{"name": "f", "parameters": {"x": [1, 2]}}; {"name": "g", "parameters": {}}', "",
     [("f", '{"x": [1, 2]}'), ("g", "{}")]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"q": "a;b"}}', "", [("f", '{"q": "a;b"}')]),
    ("llama3_json", "Hello {there}", "Hello {there}", []),
    ("llama3_json", ' {"name": "f", "parameters": {}}', ' {"name": "f", "parameters": {}}', []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
]


def _parse(fmt: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[list[str]]]:
    stream = get_tool_parser(fmt).new_stream()
    answer = ParsedAnswer()
    order = []  # per call: the kinds of its deltas, in order (name first, then arguments)
    for i, piece in enumerate(pieces):
        delta = stream.feed(piece, is_final=i == len(pieces) - 1)
        answer.add(delta)
        for call in delta.calls:
            if call.id is not None:
                assert call.name and re.fullmatch(CALL_IDS[fmt], call.id), call.id
                order.append(["name"])
            if call.arguments:
                order[call.index].append("arguments")
    return answer.content, [(c.name, c.arguments) for c in answer.calls], order


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), EXAMPLES,
                         ids=[f"{e[0]}-{i}" for i, e in enumerate(EXAMPLES)])
def test_parser_whole_and_cut_at_every_character(fmt: str, text: str, content: str,
                                                 calls: list[tuple[str, str]]) -> None:
    whole = _parse(fmt, [text])
    assert whole[:2] == (content, calls)
    for _, arguments in calls:
        if not arguments.endswith("unfinis"):
            json.loads(arguments)
    for cut in range(len(text) + 1):
        assert _parse(fmt, [text[:cut], text[cut:]])[:2] == whole[:2], cut
    by_char = _parse(fmt, list(text) + [""])
    assert by_char[:2] == whole[:2]
    assert all(kinds[0] == "name" for kinds in by_char[2])


def test_streamed_arguments_come_in_fragments_after_the_name() -> None:
    stream = get_tool_parser("hermes").new_stream()
    deltas = [stream.feed(c) for c in f"<tool_call>\n{WEATHER}\n</tool_call>"] + [stream.feed("", True)]
    calls = [c for d in deltas for c in d.calls]
    assert calls[0].name == "get_weather" and calls[0].id is not None
    assert len([c for c in calls if c.arguments]) > 5  # arguments stream as they are written


def test_parser_from_template() -> None:
    assert parser_for_template("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert parser_for_template("[TOOL_CALLS] {{ tools }}") == "mistral"
    assert parser_for_template("<|python_tag|>{{ tools }} ipython") == "llama3_json"
    assert parser_for_template(None) == "hermes"
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral"}
    with pytest.raises(ValueError, match="tool_call_parser"):
        get_tool_parser("nope")


def test_mistral_call_ids_are_nine_alphanumerics() -> None:
    stream = get_tool_parser("mistral").new_stream()
    delta = stream.feed('[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]', True)
    ids = [c.id for c in delta.calls if c.id is not None]
    assert len(ids) == 2 and len(set(ids)) == 2
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids), ids
