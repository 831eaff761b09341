"""gpt-oss's Harmony format: the o200k vocabulary written offline from a tokenizer (tokenizer.json
or a GGUF file's token list) and checked against the published hash; prompts rendered exactly as
openai-harmony's own renderer renders the same conversation; answers parsed by channel, streamed
a token at a time and whole."""
from __future__ import annotations

import json
from pathlib import Path

import openai_harmony as oh
import pytest

from engine import RequestOutput
from service.chat import harmony_vocab
from service.chat.harmony import HarmonyFormat, is_harmony_template, speaks_harmony
from service.chat.harmony_vocab import VocabularyMismatchError, byte_level_decoder
from service.chat.tool_grammar import FunctionSpec
from tests.harmony_data import ANSWER, DATE, NUM_ORDINARY_TOKENS, TIME, WEATHER, byte_level
from tests.o200k_gguf import gpt_oss_tokenizer_gguf


def test_the_vocabulary_written_from_the_tokens_has_the_published_hash(ranked: list[bytes], tmp_path: Path) -> None:
    path = harmony_vocab.write_vocabulary(ranked, tmp_path)
    assert path.name == "o200k_base.tiktoken"
    assert harmony_vocab._is_published_file(path)
    swapped = list(ranked)
    swapped[1000], swapped[1001] = swapped[1001], swapped[1000]  # two ranks exchanged: not o200k
    with pytest.raises(VocabularyMismatchError, match="not o200k_base's"):
        harmony_vocab.write_vocabulary(swapped, tmp_path / "other")
    assert not (tmp_path / "other" / "o200k_base.tiktoken").exists()


def test_byte_level_spelling_round_trips_every_byte() -> None:
    decoder = byte_level_decoder()
    assert sorted(decoder.values()) == list(range(256))
    assert decoder["Ġ"] == 0x20 and decoder["Ċ"] == 0x0A and decoder["a"] == ord("a")


def test_vocabulary_from_a_gguf_files_token_list(ranked: list[bytes], tmp_path: Path) -> None:
    path = gpt_oss_tokenizer_gguf()
    assert harmony_vocab.ranked_tokens_from_gguf(path) == ranked
    directory = harmony_vocab.vocabulary_dir([path], cache_dir=tmp_path / "cache")
    assert harmony_vocab._is_published_file(directory / "o200k_base.tiktoken")


def test_vocabulary_from_a_gguf_file_as_the_engine_reads_its_tokenizer(tmp_path: Path) -> None:
    """A GGUF model's directory holds the tokenizer transformers reads from the file
    (engine/execution/weights/checkpoint.py: write_gguf_metadata): its tokenizer.json gives the
    vocabulary, offline, and openai-harmony then tokenizes text as the model's tokenizer does."""
    from transformers import AutoTokenizer

    path = gpt_oss_tokenizer_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(str(tmp_path / "meta"))
    loaded = HarmonyFormat.load([tmp_path / "meta"], cache_dir=tmp_path / "cache")
    assert harmony_vocab._is_published_file(tmp_path / "cache" / "tiktoken" / "o200k_base.tiktoken")
    text = "Hello, wörld! 1234 — ünïcode, 日本語 and\n  code: x = f(y) + 2"
    assert tokenizer.encode(text, add_special_tokens=False) == loaded.encoding.encode(text)


def test_another_tokenizer_is_refused_naming_the_hash(ranked: list[bytes], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
    small, swapped = tmp_path / "small", tmp_path / "swapped"
    small.mkdir()
    (small / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}}}))
    with pytest.raises(VocabularyMismatchError, match="2 tokens below id 199998"):
        harmony_vocab.vocabulary_dir([small], cache_dir=tmp_path / "cache")
    spellings = byte_level(ranked)
    spellings[500], spellings[501] = spellings[501], spellings[500]
    swapped.mkdir()
    (swapped / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {s: i for i, s in enumerate(spellings)}}}))
    with pytest.raises(VocabularyMismatchError, match=f"hashes to [0-9a-f]{{64}}, openai-harmony expects {harmony_vocab.SHA256}"):
        harmony_vocab.vocabulary_dir([swapped], cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache" / "tiktoken" / "o200k_base.tiktoken").exists()


def test_which_models_speak_harmony(gpt_oss_dir: Path, tmp_path: Path) -> None:
    assert speaks_harmony(gpt_oss_dir, None)
    assert not speaks_harmony(tmp_path, "{{ '<|im_start|>' }}")
    template = "{{- '<|start|>' + role }}{{- '<|channel|>analysis<|message|>' }}"
    assert is_harmony_template(template) and speaks_harmony(tmp_path, template)


def test_gpt_oss_official_template_is_harmonys_and_others_are_not() -> None:
    from tests.llama_cpp_sdist import chat_template

    assert is_harmony_template(chat_template("openai-gpt-oss-120b"))
    for name in ("Qwen-Qwen3-0.6B", "meta-llama-Llama-3.1-8B-Instruct", "mistralai-Mistral-Nemo-Instruct-2407"):
        assert not is_harmony_template(chat_template(name)), name


def test_prompt_is_the_text_of_gpt_oss_own_template(harmony: HarmonyFormat) -> None:
    """The official template (rendered by transformers) writes the same prompt, tools and a past
    call included. (It differs on a tool result: it writes the result as a JSON string literal.)"""
    from transformers.utils.chat_template_utils import render_jinja_template

    from tests.llama_cpp_sdist import chat_template

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    chat = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "reasoning_content": "Use the tool.", "tool_calls": [call]}]
    as_template = [dict(m) for m in chat]  # the template's names: thinking, arguments as an object
    as_template[2] = {"role": "assistant", "content": "", "thinking": "Use the tool.",
                      "tool_calls": [dict(call, function={"name": "get_weather", "arguments": {"city": "Paris"}})]}
    text = render_jinja_template([as_template], tools=[WEATHER.to_openai(), TIME.to_openai()],
                                 chat_template=chat_template("openai-gpt-oss-120b"), add_generation_prompt=True,
                                 reasoning_effort="low")[0][0]
    # The template dates the prompt with today's date.
    ids = harmony.render(chat, [WEATHER, TIME], {"reasoning_effort": "low"})
    assert harmony.encoding.decode(ids) == text


def _expected(functions: list[FunctionSpec], effort: str | None, messages: list) -> list:
    system = oh.SystemContent.new().with_conversation_start_date(DATE)
    if effort is not None:
        system = system.with_reasoning_effort(oh.ReasoningEffort(effort.capitalize()))
    out = [oh.Message.from_role_and_content(oh.Role.SYSTEM, system)]
    developer = oh.DeveloperContent.new().with_instructions("Answer briefly.").with_function_tools(
        [oh.ToolDescription.new(f.name, f.description, parameters=f.parameters) for f in functions])
    return out + [oh.Message.from_role_and_content(oh.Role.DEVELOPER, developer)] + messages


def test_prompt_with_tools_calls_and_results_is_openai_harmonys(harmony: HarmonyFormat) -> None:
    chat = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
            {"role": "assistant", "content": "Sunny, 21 °C."},
            {"role": "user", "content": "And the time?"}]
    ids = harmony.render(chat, [WEATHER, TIME], {"reasoning_effort": "high"}, start_date=DATE)
    A = oh.Role.ASSISTANT
    expected = _expected([WEATHER, TIME], "high", [
        oh.Message.from_role_and_content(oh.Role.USER, "Weather in Paris?"),
        oh.Message.from_role_and_content(A, "Use the tool.").with_channel("analysis"),
        oh.Message.from_role_and_content(A, '{"city": "Paris"}').with_channel("commentary")
        .with_recipient("functions.get_weather").with_content_type("json"),
        oh.Message.from_author_and_content(oh.Author.new(oh.Role.TOOL, "functions.get_weather"), '{"temp_c": 21}')
        .with_channel("commentary").with_recipient("assistant"),
        oh.Message.from_role_and_content(A, "Sunny, 21 °C.").with_channel("final"),
        oh.Message.from_role_and_content(oh.Role.USER, "And the time?")])
    want = harmony.encoding.render_conversation_for_completion(oh.Conversation.from_messages(expected), A)
    assert ids == want
    text = harmony.encoding.decode(ids)
    assert "namespace functions" in text and "type get_weather = (_: {" in text
    assert "to=functions.get_weather" in text and "Reasoning: high" in text and text.endswith("<|start|>assistant")
    # the tool's result as Harmony writes it (not only as the mirror above builds it)
    assert ('<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"temp_c": 21}<|end|>'
            in text), text
    # Mid-turn (the tool's result just came): the turn's analysis is kept, and rendered.
    mid = harmony.render(chat[:4], [WEATHER, TIME], {"reasoning_effort": "high"}, start_date=DATE)
    assert mid == harmony.encoding.render_conversation_for_completion(
        oh.Conversation.from_messages(expected[:6]), A)
    assert "<|channel|>analysis<|message|>Use the tool.<|end|>" in harmony.encoding.decode(mid)
    # A different conversation renders differently (the comparison can fail).
    other = harmony.render(chat[:-1] + [{"role": "user", "content": "And the date?"}], [WEATHER, TIME],
                           {"reasoning_effort": "high"}, start_date=DATE)
    assert other != want


def _outputs(harmony: HarmonyFormat, text: str, per_output: int, finish: str = "stop") -> list[RequestOutput]:
    ids = harmony.encoding.encode(text, allowed_special="all")
    outs = []
    for start in range(0, len(ids), per_output):
        new = ids[start:start + per_output]
        last = start + per_output >= len(ids)
        # the engine's text skips special tokens, as it decodes with skip_special_tokens
        text = harmony.encoding.decode([t for t in new if t < NUM_ORDINARY_TOKENS])
        outs.append(RequestOutput("r", [1], ids[:start + len(new)], "", new, text,
                                  finish_reason=finish if last else None))
    return outs


@pytest.mark.parametrize("per_output", [1, 3, 1000])
def test_answer_parses_into_reasoning_a_call_and_content(harmony: HarmonyFormat, per_output: int) -> None:
    output = harmony.new_output()
    deltas = [output.feed(out) for out in _outputs(harmony, ANSWER, per_output)]
    message = output.message()
    assert message["reasoning_content"] == "The user wants the weather; call the tool."
    assert message["content"] == "It is sunny in Paris, 21 °C."
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert call["id"].startswith("call_")
    assert output.finish_reason("stop") == "tool_calls"
    assert "".join(d.reasoning for d in deltas) == "The user wants the weather; call the tool."
    assert "".join(d.parsed.content for d in deltas) == "It is sunny in Paris, 21 °C."
    assert [c.name for d in deltas for c in d.parsed.calls] == ["get_weather"]  # sent once, whole
    assert output.num_reasoning_tokens > 0


def test_a_call_cut_by_max_tokens_is_content(harmony: HarmonyFormat) -> None:
    cut = ANSWER[:ANSWER.index('"Paris"}')]
    output = harmony.new_output()
    for out in _outputs(harmony, cut, 2, finish="length"):
        output.feed(out)
    message = output.message()
    assert "tool_calls" not in message and message["content"] == '{"city": '
    assert output.finish_reason("length") == "length"


def test_stop_tokens_are_return_and_call(harmony: HarmonyFormat) -> None:
    assert sorted(harmony.stop_token_ids) == [200002, 200012]


@pytest.mark.parametrize(("text", "content"), [
    ("Plain words, no header at all.", "Plain words, no header at all."),  # never in the format: all content
    ("<|channel|>final<|message|>ok<|end|>then garbage<|return|>", "okthen garbage"),  # left it: the rest
    ("<|message|>no channel<|return|>", "no channel"),
])
def test_an_answer_off_the_format_keeps_its_text(harmony: HarmonyFormat, text: str, content: str) -> None:
    output = harmony.new_output()
    for out in _outputs(harmony, text, 1):
        output.feed(out)
    assert output.message()["content"] == content


def test_a_developer_message_is_instructions_as_a_system_one(harmony: HarmonyFormat) -> None:
    """gRPC passes the role through (HTTP folds it into system first): both give the instructions."""
    user = {"role": "user", "content": "Weather in Paris?"}
    as_system = harmony.render([{"role": "system", "content": "Answer briefly."}, user], [WEATHER], None,
                               start_date=DATE)
    as_developer = harmony.render([{"role": "developer", "content": "Answer briefly."}, user], [WEATHER], None,
                                  start_date=DATE)
    assert as_developer == as_system and "Answer briefly." in harmony.encoding.decode(as_developer)
