"""A chat request's tools and reasoning, before generation: how the chat is rendered (the
model's template with tools=, or the generic format for a template that knows no tools), which
grammar constrains the answer and which parsers read it. Shared by /v1/chat/completions,
/v1/responses and gRPC.

The generic format (docs/openai_tools.md): a system block lists the functions as JSON and
shows the call layout of the active parser (Hermes-style <tool_call> JSON </tool_call> unless
the server says otherwise); earlier calls are written into their assistant messages in that
layout, and tool results go back as user messages wrapped in <tool_response> tags.

A model that speaks Harmony (gpt-oss: service/chat/harmony.py) is planned apart: openai-harmony
renders its prompt to token ids and parses its answer (no template, no tool grammar).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine import FieldError, RequestOutput, SamplingParams, StructuredOutput
from service.async_engine import AsyncEngine
from service.chat import harmony
from service.chat.harmony import HarmonyFormat
from service.chat.output import ChoiceOutput, StopSample
from service.chat.reasoning_parser import ReasoningParser, get_reasoning_parser
from service.chat.template_traits import TemplateTraits, read_template_traits, template_text
from service.chat.tool_grammar import FunctionSpec, LarkText, tool_call_grammar
from service.chat.tool_parsers import ToolParser, get_tool_parser, parser_for_template
from service.serving_state import EngineUnavailableError

logger = logging.getLogger(__name__)

TOOL_CHOICES = ("none", "auto", "required")
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """What a request asked: its functions, tool_choice ("none" | "auto" | "required" | a
    function's name, with is_named) and whether several calls may come at once."""

    functions: list[FunctionSpec] = field(default_factory=list)
    choice: str = "auto"
    is_named: bool = False
    parallel: bool = True

    def check(self) -> None:
        seen = set()
        for i, function in enumerate(self.functions):
            if not _FUNCTION_NAME.fullmatch(function.name):
                raise FieldError(f"tools[{i}].name", f"{function.name!r} must be 1-64 letters, digits, "
                                 "_ . : or -")
            if function.name in seen:
                raise FieldError(f"tools[{i}].name", f"{function.name!r} is defined twice")
            if function.parameters is not None and not isinstance(function.parameters, dict):
                raise FieldError(f"tools[{i}].parameters", "must be a JSON schema object")
            seen.add(function.name)
        if self.is_named and self.choice not in seen:
            raise FieldError("tool_choice", f"no function named {self.choice!r} among the tools")
        if not self.is_named and self.choice not in TOOL_CHOICES:
            raise FieldError("tool_choice", f"{self.choice!r} is not one of {', '.join(TOOL_CHOICES)} "
                             "or a function")
        if self.choice == "required" and not self.functions:
            raise FieldError("tool_choice", "required needs tools")

    @property
    def is_active(self) -> bool:
        """The answer may hold calls (and is parsed for them)."""
        return bool(self.functions) and self.choice != "none"


@dataclass(slots=True)
class ChatPlan:
    messages: list[dict[str, Any]]
    template_kwargs: dict[str, Any] | None
    structured_output: StructuredOutput | None
    tool_parser: ToolParser | None  # None: the answer is not parsed for calls
    reasoning: ReasoningParser | None
    keep_special_tokens: bool = False  # the format's trigger is a special token: the parser must see it
    reasoning_marker_ids: tuple[int, int] | None = None  # <think>, </think> when each is one token
    # Harmony (gpt-oss): the prompt as token ids, rendered by openai-harmony, and its format,
    # which parses every answer (reasoning, content and calls come apart by channel).
    harmony: HarmonyFormat | None = None
    prompt_token_ids: list[int] | None = None

    def new_output(self, stop_sample: StopSample | None = None) -> ChoiceOutput:
        """One sample's parse of the answer; stop_sample (AsyncEngine.stop_sample) ends the
        sample's generation once a repeated call has ended its answer."""
        if self.harmony is not None:
            return self.harmony.new_output()
        return ChoiceOutput(self.reasoning, self.tool_parser, self.reasoning_marker_ids, stop_sample)

    @property
    def is_parsed(self) -> bool:
        """The answer is parsed (for calls, reasoning, or Harmony's channels), not passed through."""
        return self.tool_parser is not None or self.reasoning is not None or self.harmony is not None

    @property
    def has_reasoning(self) -> bool:
        """The answer may think (its usage counts reasoning tokens)."""
        return self.reasoning is not None or self.harmony is not None

    @property
    def is_tool_grammar(self) -> bool:
        return self.tool_parser is not None and self.structured_output is not None


class ChatTools:
    """The server's choices (tool_call_parser: a format's name or "auto", from the template;
    reasoning_parser: a name, "auto" (from the template) or None / "none" for off) and the
    planning of each chat request."""

    def __init__(self, tool_call_parser: str = "auto", reasoning_parser: str | None = "auto") -> None:
        """harmony for either parser: gpt-oss's format, whatever the model (auto picks it for a
        model that speaks it)."""
        if tool_call_parser not in ("auto", harmony.NAME):
            get_tool_parser(tool_call_parser)  # refuses an unknown name at start-up
        if reasoning_parser not in (None, "none", "auto", harmony.NAME):
            get_reasoning_parser(reasoning_parser)
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = None if reasoning_parser == "none" else reasoning_parser
        self._traits: dict[str, TemplateTraits] = {}  # by template text: one probe per template
        # By tokenizer directory, loaded once: the format, None (not Harmony), or why it cannot load.
        self._harmony: dict[str, HarmonyFormat | str | None] = {}

    async def harmony_format(self, engine: AsyncEngine) -> HarmonyFormat | None:
        """The Harmony format when the server was told to use it or the model speaks it (its
        vocabulary written from the model's tokenizer once, off the event loop); else None.
        EngineUnavailableError (503) when its vocabulary cannot be had: no chat can be served."""
        info = engine.model_info()
        key = info.tokenizer_dir
        if key not in self._harmony:
            model_dir, tokenizer_dir = Path(info.model_dir), Path(info.tokenizer_dir)
            told = harmony.NAME in (self.tool_call_parser, self.reasoning_parser)
            if told or (self.tool_call_parser == "auto" and self.reasoning_parser in ("auto", None)
                        and harmony.speaks_harmony(model_dir, template_text(engine))):
                sources = harmony.vocabulary_sources(model_dir, tokenizer_dir)
                try:
                    self._harmony[key] = await asyncio.get_running_loop().run_in_executor(
                        None, HarmonyFormat.load, sources)
                except (OSError, ValueError) as exc:  # no vocabulary file, or not o200k's
                    logger.error("the Harmony format cannot load: %s", exc)
                    self._harmony[key] = f"chats need the Harmony format's o200k vocabulary, which cannot load: {exc}"
            else:
                self._harmony[key] = None
        found = self._harmony[key]
        if isinstance(found, str):
            raise EngineUnavailableError(found)
        return found

    async def traits(self, engine: AsyncEngine) -> TemplateTraits:
        """The model's template's traits, probed once (an engine restarted on another model
        has another template, probed anew)."""
        template = template_text(engine)
        if template not in self._traits:
            self._traits[template] = await read_template_traits(engine)
        return self._traits[template]

    def reasoning_for(self, traits: TemplateTraits, enable_thinking: bool | None = None) -> ReasoningParser | None:
        """A request's reasoning parser: the one the server was told, or under auto the
        template's for the request's enable_thinking; none when enable_thinking is false."""
        if enable_thinking is False:
            return None
        name = traits.reasoning_parser(enable_thinking) if self.reasoning_parser == "auto" else self.reasoning_parser
        return get_reasoning_parser(name) if name else None

    async def prepare(self, engine: AsyncEngine, messages: list[dict[str, Any]], tools: ToolRequest,
                      params: SamplingParams, template_kwargs: dict[str, Any] | None
                      ) -> tuple[ChatPlan, SamplingParams]:
        """The chat's plan and the parameters that carry its grammar (and keep its special trigger)."""
        check_template_kwargs(template_kwargs)
        if params.stop and tools.is_active and (tools.choice == "required" or tools.is_named):
            # The call is the whole answer: a stop string can only cut it short of parsing.
            raise FieldError("stop", "cannot go with tool_choice required or a named function (a stop string "
                             "would cut the call)")
        plan = await self.plan(engine, messages, tools, params.structured_output, template_kwargs)
        changes: dict[str, Any] = {}
        if plan.structured_output != params.structured_output:
            changes["structured_output"] = plan.structured_output
        if plan.keep_special_tokens:
            changes["skip_special_tokens"] = False
        if plan.harmony is not None:
            stops = [t for t in plan.harmony.stop_token_ids if t not in params.stop_token_ids]
            changes["stop_token_ids"] = [*params.stop_token_ids, *stops]
        return plan, dataclasses.replace(params, **changes) if changes else params

    @staticmethod
    async def generate(engine: AsyncEngine, request_id: str, params: SamplingParams, plan: ChatPlan,
                       engine_id: str | None = None, priority: int = 0) -> AsyncGenerator[RequestOutput, None]:
        """Admit a planned chat; a tool grammar the compiler refuses is the tools' fault, named so."""
        try:
            if plan.prompt_token_ids is not None:
                return await engine.generate(request_id, params, prompt=plan.prompt_token_ids,
                                             engine_id=engine_id or request_id, priority=priority)
            return await engine.generate(request_id, params, messages=plan.messages,
                                         engine_id=engine_id or request_id, chat_template_kwargs=plan.template_kwargs,
                                         priority=priority)
        except FieldError as exc:
            if plan.is_tool_grammar and exc.field == "structured_output.grammar":
                raise FieldError("tools", f"a function's parameters cannot constrain the answer: {exc.message}") from None
            raise

    async def prompt_ids(self, engine: AsyncEngine, messages: list[dict[str, Any]], tools: ToolRequest,
                         template_kwargs: dict[str, Any] | None) -> list[int]:
        """A chat's prompt ids as a generation of it sees them: Harmony's rendering, or the chat
        template's over the plan's messages (both doors' tokenize)."""
        plan = await self.plan(engine, messages, tools, None, template_kwargs)
        if plan.prompt_token_ids is not None:  # Harmony: rendered already
            return list(plan.prompt_token_ids)
        return await engine.tokenize(messages=plan.messages, chat_template_kwargs=plan.template_kwargs)

    async def plan(self, engine: AsyncEngine, messages: list[dict[str, Any]], tools: ToolRequest,
                   structured: StructuredOutput | None, template_kwargs: dict[str, Any] | None) -> ChatPlan:
        harmony_format = await self.harmony_format(engine)
        if harmony_format is not None:
            # Off the event loop: rendering tokenizes the whole chat (tens of ms for a long one).
            return await asyncio.get_running_loop().run_in_executor(
                None, self._harmony_plan, harmony_format, messages, tools, structured, template_kwargs)
        traits = await self.traits(engine)
        name = self.tool_call_parser if self.tool_call_parser != "auto" else parser_for_template(template_text(engine))
        parser = get_tool_parser(name)
        kwargs = dict(template_kwargs or {})
        messages = _with_call_arguments_parsed(messages)
        if traits.knows_tools:
            if tools.is_active:
                kwargs["tools"] = [f.to_openai() for f in tools.functions]
        else:
            messages = generic_messages(messages, parser, tools.functions if tools.is_active else [],
                                        has_system_role=traits.has_system_role)
        reasoning = self.reasoning_for(traits, kwargs.get("enable_thinking"))
        thinks = reasoning is not None
        keep_special = False
        if tools.is_active:
            if structured is not None and structured.kind not in ("json_schema", "json_object"):
                raise FieldError("tools", "only a JSON {0} can go with tools", mentions=("response_format",))
            if structured is not None and tools.choice != "auto":
                raise FieldError("response_format", "tool_choice required or a named function decides the answer")
            added = await engine.added_tokens()
            # llguidance never matches these as text: a grammar names them by id.
            lit = LarkText({text: i for text, (i, special) in added.items()
                            if special or (text.startswith("<") and text.endswith(">"))})
            keep_special = parser.trigger in added and added[parser.trigger][1]
            functions = [f for f in tools.functions if not tools.is_named or f.name == tools.choice]
            answer = None
            if structured is not None:
                answer = json.loads(structured.value) if structured.kind == "json_schema" else {"type": "object"}
            grammar = tool_call_grammar(parser, functions, required=tools.choice == "required" or tools.is_named,
                                        parallel=tools.parallel and not tools.is_named,
                                        lit=lit, answer_schema=answer)
            structured = StructuredOutput("grammar", grammar)
        marker_ids = None
        if thinks:
            added = await engine.added_tokens()
            if reasoning.start in added and reasoning.end in added:
                marker_ids = (added[reasoning.start][0], added[reasoning.end][0])
        if structured is not None and thinks:
            # Only a model that may answer without thinking (qwen3) gets the block as an option.
            opener = "" if reasoning.starts_in_reasoning else reasoning.start
            structured = StructuredOutput(structured.kind, structured.value, after=reasoning.end,
                                          after_opener=opener)
        return ChatPlan(messages, kwargs or None, structured, parser if tools.is_active else None,
                        reasoning if thinks else None, keep_special, reasoning_marker_ids=marker_ids)

    @staticmethod
    def _harmony_plan(harmony_format: HarmonyFormat, messages: list[dict[str, Any]], tools: ToolRequest,
                      structured: StructuredOutput | None, template_kwargs: dict[str, Any] | None) -> ChatPlan:
        """A Harmony chat: its prompt rendered by openai-harmony. No grammar constrains the answer
        (a call is the model's choice; tool_choice required or named and a response_format would
        need one over Harmony's channels, which is not built)."""
        if tools.is_active and (tools.choice == "required" or tools.is_named):
            raise FieldError("tool_choice", "only auto or none is served with the Harmony format (gpt-oss)")
        if structured is not None:
            raise FieldError("response_format", "is not served with the Harmony format (gpt-oss)")
        functions = tools.functions if tools.is_active else []
        ids = harmony_format.render(messages, functions, template_kwargs)
        return ChatPlan(messages, template_kwargs, None, None, None, harmony=harmony_format, prompt_token_ids=ids)


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    """vLLM's chat_template_kwargs: any template variables, except what the request says in
    fields of its own (tools) and an enable_thinking that is not a boolean (a template tests it
    with `is false`, the reasoning parser with Python's False: "false" would split them)."""
    if not kwargs:
        return
    if "tools" in kwargs:
        raise FieldError("chat_template_kwargs.tools", "send tools in the request's tools field")
    if "enable_thinking" in kwargs and not isinstance(kwargs["enable_thinking"], bool):
        raise FieldError("chat_template_kwargs.enable_thinking", "must be true or false")


def _with_call_arguments_parsed(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Templates expect a call's arguments as an object (OpenAI sends JSON text); a tool result
    gets its call's function name too (some templates show it)."""
    names: dict[str, str] = {}
    out = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                function = dict(call["function"])
                try:
                    function["arguments"] = json.loads(function.get("arguments") or "{}")
                except ValueError:
                    pass  # not JSON: the template gets the text
                names[call.get("id", "")] = function["name"]
                calls.append(dict(call, function=function))
            message["tool_calls"] = calls
        if message.get("role") == "tool" and "name" not in message and message.get("tool_call_id") in names:
            message["name"] = names[message["tool_call_id"]]
        out.append(message)
    return out


def generic_system_block(parser: ToolParser, functions: list[FunctionSpec]) -> str:
    listing = "\n".join(json.dumps(f.to_openai(), ensure_ascii=False) for f in functions)
    example = parser.render_calls([("function_name", {"argument_name": "value"})])
    return ("# Tools\n\nYou can call functions to help answer. Each function is described by a JSON object:\n"
            f"<tools>\n{listing}\n</tools>\n\nTo call functions, answer with the call(s) alone, written exactly "
            f"like this (arguments as a JSON object matching the function's parameters):\n{example}\n"
            "The results come back in <tool_response> tags. If no function helps, just answer.")


def generic_messages(messages: list[dict[str, Any]], parser: ToolParser, functions: list[FunctionSpec],
                     has_system_role: bool = True) -> list[dict[str, Any]]:
    """The chat in the generic format, for a template that knows no tools: roles and plain
    content only. A template with no system role (Gemma's) gets the tools block at the start of
    the first user turn instead (a system message of the client's own is still its to refuse)."""
    out: list[dict[str, Any]] = []
    if functions:
        block = generic_system_block(parser, functions)
        if not has_system_role:
            messages = _before_first_user(messages, block)
        elif messages and messages[0].get("role") == "system":
            out.append({"role": "system", "content": f"{messages[0]['content']}\n\n{block}"})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": block})
    for message in messages:
        role, content = message.get("role"), message.get("content") or ""
        if message.get("tool_calls"):
            calls = parser.render_calls([(c["function"]["name"], c["function"]["arguments"])
                                         for c in message["tool_calls"]])
            out.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        elif role == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("is_tool_response"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "is_tool_response": True})
        else:
            out.append({"role": role, "content": content})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def _before_first_user(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """text at the start of the first user message (a user message of its own first when there
    is none)."""
    out = [dict(m) for m in messages]
    for message in out:
        if message.get("role") == "user":
            message["content"] = f"{text}\n\n{message.get('content') or ''}"
            return out
    return [{"role": "user", "content": text}] + out
