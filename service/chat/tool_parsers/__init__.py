"""Tool-call parsers, one per format, registered by name (the server's tool_call_parser
option): hermes (also the generic format), llama3_json, mistral."""
from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from service.chat.tool_parsers.base import (
    CutCall,
    ParsedAnswer,
    ParsedDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
)
from service.chat.tool_parsers.hermes import HermesToolParser
from service.chat.tool_parsers.llama3_json import Llama3JsonToolParser
from service.chat.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: Mapping[str, type[ToolParser]] = MappingProxyType(
    {cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)})
GENERIC_PARSER = HermesToolParser.name  # the format of templates that know no tools


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered under name; ValueError naming tool_call_parser if none is."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser: {name!r} is not one of {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()


def parser_for_template(template: str | None) -> str:
    """The format a chat template writes calls in, by the markers it mentions; the generic
    (Hermes-style) format for a template that mentions none."""
    template = template or ""
    if "[TOOL_CALLS]" in template:
        return MistralToolParser.name
    if "<tool_call>" in template:
        return HermesToolParser.name
    if "<|python_tag|>" in template or "ipython" in template:
        return Llama3JsonToolParser.name
    return GENERIC_PARSER


__all__ = ["GENERIC_PARSER", "TOOL_PARSERS", "CutCall", "ParsedAnswer", "ParsedDelta", "ToolCall", "ToolCallDelta",
           "ToolCallStream", "ToolParser", "get_tool_parser", "parser_for_template"]
