"""What a model's chat template does with a chat, found by rendering two small probe chats once
per template (the text of a template says too little: Gemma's refuse or fold a system message,
DeepSeek-R1's opens the thinking block in the prompt, Qwen3's leaves it to the answer).

The server's `auto` choices come from here: the reasoning parser (a template that writes
<think> blocks thinks; one whose generation prompt ends inside an open block starts its answer
in thinking) and where the generic tools block goes (a system message, or the first user turn
for a template without a system role).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from engine import FieldError
from service.async_engine import AsyncEngine
from service.chat.reasoning_parser import END, START

logger = logging.getLogger(__name__)

_PROBE_SYSTEM = "You are a probe."
_PROBE_USER = "Hello."


@dataclass(frozen=True, slots=True)
class TemplateTraits:
    knows_tools: bool  # the template mentions tools: it gets them as tools=
    has_system_role: bool  # a system message renders (Gemma 2's template refuses one)
    writes_thinking: bool  # the template knows <think> blocks (Qwen3, DeepSeek-R1, QwQ)
    # Its generation prompt ends inside an open <think>: with no enable_thinking, and with it true
    # (llama.cpp's DeepSeek-R1 and QwQ templates close the block unless thinking is asked for).
    opens_thinking: bool = False
    opens_thinking_when_asked: bool = False

    def reasoning_parser(self, enable_thinking: bool | None = None) -> str | None:
        """The reasoning parser this template's answers need, for a request's enable_thinking
        (None: not given); None: the answer does not think."""
        if enable_thinking is False or not self.writes_thinking:
            return None
        if self.opens_thinking_when_asked if enable_thinking else self.opens_thinking:
            return "deepseek_r1"  # the answer starts in thinking, with no <think> of its own
        return "qwen3"  # only an answer that opens <think> thinks


def template_text(engine: AsyncEngine) -> str:
    """The model's chat template as text ("" when it has none; a list of named templates as JSON)."""
    template = engine.tokenizer_info().get("chat_template")
    if template is None:
        return ""
    return template if isinstance(template, str) else json.dumps(template)


async def read_template_traits(engine: AsyncEngine) -> TemplateTraits:
    """Render the probes on the tokenizer thread: a system + user chat (refused or not), and a
    user turn's generation prompt without enable_thinking and with it true (where does it end?)."""
    template = template_text(engine)
    if not template:
        return TemplateTraits(knows_tools=False, has_system_role=False, writes_thinking=False)
    try:
        await engine.tokenize(messages=[{"role": "system", "content": _PROBE_SYSTEM},
                                        {"role": "user", "content": _PROBE_USER}])
        has_system_role = True
    except FieldError:  # the template's raise_exception: no system role
        has_system_role = False
    writes_thinking = START in template and END in template
    opens = [False, False]
    if writes_thinking:
        for i, kwargs in enumerate((None, {"enable_thinking": True})):
            ids = await engine.tokenize(messages=[{"role": "user", "content": _PROBE_USER}],
                                        chat_template_kwargs=kwargs)
            opens[i] = (await engine.detokenize(ids)).rstrip().endswith(START)
    traits = TemplateTraits(knows_tools="tools" in template, has_system_role=has_system_role,
                            writes_thinking=writes_thinking, opens_thinking=opens[0], opens_thinking_when_asked=opens[1])
    logger.info("chat template: %s", traits)
    return traits
