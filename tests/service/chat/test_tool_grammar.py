"""The tool-call grammars of every format, compiled by llguidance over real tokenizers (the tiny
tool model's, whose <tool_call> is an added token, and the default model's, whose template knows
no tools, so its calls open with <tool_call> written as text: the lazy trigger): each accepts
its format's calls with valid arguments and refuses invalid ones, and auto mode lets text
through until a call starts."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from llguidance import LLMatcher
from llguidance.hf import from_tokenizer
from transformers import AutoTokenizer

from service.chat.tool_grammar import FunctionSpec, LarkText, tool_call_grammar
from service.chat.tool_parsers import TOOL_PARSERS, get_tool_parser
from tests.service.tool_cases import TIME, WEATHER

FUNCTIONS = [FunctionSpec("get_weather", "", WEATHER), FunctionSpec("get_time", "", TIME)]
GOOD = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "UTC"})]
BAD = [("get_weather", {"city": "Paris", "days": 99})]  # days above the schema's maximum


class Grammars:
    """A tokenizer as the server sees it: llguidance's view and the added tokens a grammar names by id."""

    def __init__(self, model_dir: Path) -> None:
        self.hf = AutoTokenizer.from_pretrained(str(model_dir))
        self.tokenizer = from_tokenizer(self.hf, n_vocab=len(self.hf), eos_token=self.hf.eos_token_id)
        added = {str(t): (i, bool(t.special)) for i, t in self.hf.added_tokens_decoder.items()}
        self.lit = LarkText({text: i for text, (i, special) in added.items()
                             if special or (text.startswith("<") and text.endswith(">"))})

    def accepts(self, grammar: str, text: str) -> bool:
        """The whole text is allowed and may end there."""
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        ids = self.hf.encode(text, add_special_tokens=False)
        return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()


@pytest.fixture(scope="module")
def tiny(tiny_tool_model_dir: Path) -> Grammars:
    return Grammars(tiny_tool_model_dir)


@pytest.fixture(scope="module")
def default_model() -> Grammars:
    from engine.execution.weights.checkpoint import resolve_model

    return Grammars(resolve_model(None))


def _calls(fmt: str, calls: list[tuple[str, Any]]) -> str:
    return get_tool_parser(fmt).render_calls(calls)


def _check_format(grammars: Grammars, fmt: str) -> None:
    parser = get_tool_parser(fmt)
    one, both = _calls(fmt, GOOD[:1]), _calls(fmt, GOOD)
    bad = _calls(fmt, BAD)
    for required in (True, False):
        for parallel in (True, False):
            grammar = tool_call_grammar(parser, FUNCTIONS, required=required, parallel=parallel, lit=grammars.lit)
            assert grammars.accepts(grammar, one), (fmt, required, parallel)
            assert grammars.accepts(grammar, both) == parallel, (fmt, required, parallel)
            assert not grammars.accepts(grammar, bad), (fmt, required, parallel)
            assert not grammars.accepts(grammar, one.replace("get_weather", "get_wether"))
            text = "Let me look that up."
            assert grammars.accepts(grammar, text) != required  # auto: text is an answer
            if parser.trigger:  # auto: text, then a call once the trigger appears
                assert grammars.accepts(grammar, f"{text} {one}") != required
                assert not grammars.accepts(grammar, f"{text} {bad}")


@pytest.mark.parametrize("fmt", sorted(TOOL_PARSERS))
def test_each_formats_grammar_on_the_tiny_tokenizer(tiny: Grammars, fmt: str) -> None:
    _check_format(tiny, fmt)


@pytest.mark.real_model
@pytest.mark.parametrize("fmt", sorted(TOOL_PARSERS))
def test_each_formats_grammar_on_the_default_models_tokenizer(default_model: Grammars, fmt: str) -> None:
    """The default model's template knows no tools and has no <tool_call> token: the generic
    (hermes) format's trigger is text, so auto mode's free text ends at it lazily."""
    assert "<tool_call>" not in default_model.lit.added
    _check_format(default_model, fmt)


def test_the_lazy_trigger_ends_free_text_at_the_first_call(default_model: Grammars) -> None:
    parser = get_tool_parser("hermes")
    grammar = tool_call_grammar(parser, FUNCTIONS, required=False, parallel=False, lit=default_model.lit)
    assert "[lazy]" in grammar
    call = json.dumps({"name": "get_time", "arguments": {"tz": "UTC"}})
    assert default_model.accepts(grammar, f"Sure.\n<tool_call>\n{call}\n</tool_call>")
    # Once <tool_call> is written the call is held to its schema: not more text, not a bad call.
    assert not default_model.accepts(grammar, "Sure. <tool_call> and some more text")
    assert not default_model.accepts(grammar, '<tool_call>\n{"name": "get_time", "arguments": {"tz": "PST"}}\n</tool_call>')
    # Text that only resembles the trigger stays text.
    assert default_model.accepts(grammar, "a <tool_cal> b < tool_call>")
