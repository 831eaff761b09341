"""gpt-oss's Harmony chat format as the server uses it: whether the served model speaks it, and
the format itself (openai-harmony's encoding: prompts rendered by it, answers parsed by it).

A model speaks Harmony when its config's model_type is gpt_oss, or its chat template is
gpt-oss's (it writes <|channel|> headers: the template a GGUF file carries, whatever the config
says). The server's `harmony` tool_call_parser / reasoning_parser names it outright.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.chat.harmony_output import HarmonyOutput
from service.chat.harmony_prompt import render_prompt
from service.chat.harmony_vocab import load_harmony_encoding
from service.chat.tool_grammar import FunctionSpec

logger = logging.getLogger(__name__)

NAME = "harmony"  # as the server's tool_call_parser and reasoning_parser
MODEL_TYPES = frozenset({"gpt_oss"})
_TEMPLATE_MARKERS = ("<|channel|>", "<|start|>", "<|message|>")


def is_harmony_template(template: str | None) -> bool:
    return bool(template) and all(marker in template for marker in _TEMPLATE_MARKERS)


def model_type(model_dir: Path) -> str | None:
    """config.json's model_type (None without one)."""
    try:
        return json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError):
        return None


def speaks_harmony(model_dir: Path, template: str | None) -> bool:
    return model_type(model_dir) in MODEL_TYPES or is_harmony_template(template)


def vocabulary_sources(model_dir: Path, tokenizer_dir: Path) -> list[Path]:
    """Where gpt-oss's tokenizer may be: the tokenizer's and the model's directories
    (tokenizer.json), and a GGUF file in the model's."""
    return [tokenizer_dir, model_dir, *sorted(model_dir.glob("*.gguf"))]


@dataclass(frozen=True, slots=True)
class HarmonyFormat:
    encoding: Any  # openai_harmony.HarmonyEncoding

    @classmethod
    def load(cls, sources: Sequence[Path], cache_dir: Path | None = None) -> HarmonyFormat:
        """The format with its vocabulary written from the sources once (harmony_vocab.py)."""
        return cls(load_harmony_encoding(sources, cache_dir))

    @property
    def stop_token_ids(self) -> list[int]:
        """<|return|> (the answer is over) and <|call|> (the assistant waits for a tool)."""
        return list(self.encoding.stop_tokens_for_assistant_actions())

    def render(self, messages: Sequence[dict[str, Any]], functions: Sequence[FunctionSpec],
               template_kwargs: dict[str, Any] | None = None, start_date: str | None = None) -> list[int]:
        """The chat's prompt ids; chat_template_kwargs' reasoning_effort (low, medium, high) as
        gpt-oss's template takes it."""
        effort = (template_kwargs or {}).get("reasoning_effort")
        return render_prompt(self.encoding, messages, functions, effort, start_date)

    def new_output(self) -> HarmonyOutput:
        return HarmonyOutput(self.encoding)
