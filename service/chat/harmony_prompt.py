"""A chat rendered as gpt-oss's Harmony prompt, by openai-harmony's own renderer.

The chat's messages (as service/openai/protocol.py hands them: developer already folded into
system) map onto Harmony's roles and channels the way gpt-oss's own chat template does:
- Harmony's system message (model identity, reasoning effort, today's date, the channels) is
  the renderer's, not the client's; the client's system messages become the developer message's
  instructions, and the request's functions its `functions` namespace;
- a user message is a user message;
- an assistant message: its reasoning_content on the analysis channel, its content on the final
  channel, each call on the commentary channel addressed to=functions.NAME with JSON arguments
  (content type `json`, as gpt-oss's template writes a past call);
- a tool result is a message from the tool (functions.NAME, found by its tool_call_id) to the
  assistant on the commentary channel.
Earlier analysis the renderer drops itself (auto_drop_analysis: the model only sees the
thinking of the turn it is in).
"""
from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from typing import Any

from engine import FieldError
from service.chat.tool_grammar import FunctionSpec

REASONING_EFFORTS = ("low", "medium", "high")
# Harmony's developer message holds the instructions: a chat's system and developer messages alike.
_INSTRUCTION_ROLES = ("system", "developer")
FUNCTIONS_NAMESPACE = "functions"


def _function_tool(function: FunctionSpec):  # -> ToolDescription
    from openai_harmony import ToolDescription

    return ToolDescription.new(function.name, function.description or "", parameters=function.parameters)


def _call_arguments(arguments: Any) -> str:
    """A call's arguments as the JSON text the model wrote (OpenAI sends text; an object is dumped)."""
    if isinstance(arguments, str):
        return arguments or "{}"
    return json.dumps(arguments, ensure_ascii=False)


def harmony_messages(messages: Sequence[dict[str, Any]], functions: Sequence[FunctionSpec],
                     reasoning_effort: str | None = None, start_date: str | None = None) -> list[Any]:
    """The chat as openai-harmony Messages, its system and developer messages first.
    start_date: the conversation's date as YYYY-MM-DD (today's when None)."""
    from openai_harmony import Author, DeveloperContent, Message, ReasoningEffort, Role, SystemContent

    if reasoning_effort is not None and reasoning_effort not in REASONING_EFFORTS:
        raise FieldError("chat_template_kwargs.reasoning_effort",
                         f"{reasoning_effort!r} is not one of {', '.join(REASONING_EFFORTS)}")
    system = SystemContent.new().with_conversation_start_date(start_date or datetime.date.today().isoformat())
    if reasoning_effort is not None:
        system = system.with_reasoning_effort(ReasoningEffort(reasoning_effort.capitalize()))
    out = [Message.from_role_and_content(Role.SYSTEM, system)]
    instructions = "\n\n".join(m.get("content") or "" for m in messages if m.get("role") in _INSTRUCTION_ROLES)
    if instructions or functions:
        developer = DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions(instructions)
        if functions:
            developer = developer.with_function_tools([_function_tool(f) for f in functions])
        out.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    call_names: dict[str, str] = {}  # tool_call_id -> the function it called
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content") or ""
        if role in _INSTRUCTION_ROLES:
            continue
        if role == "user":
            out.append(Message.from_role_and_content(Role.USER, content))
        elif role == "assistant":
            if message.get("reasoning_content"):
                out.append(Message.from_role_and_content(Role.ASSISTANT, message["reasoning_content"])
                           .with_channel("analysis"))
            for call in message.get("tool_calls") or []:
                function = call["function"]
                call_names[call.get("id") or ""] = function["name"]
                out.append(Message.from_role_and_content(Role.ASSISTANT, _call_arguments(function.get("arguments")))
                           .with_channel("commentary").with_recipient(f"{FUNCTIONS_NAMESPACE}.{function['name']}")
                           .with_content_type("json"))
            if content:
                out.append(Message.from_role_and_content(Role.ASSISTANT, content).with_channel("final"))
        elif role == "tool":
            name = message.get("name") or call_names.get(message.get("tool_call_id") or "")
            if name is None:
                raise FieldError(f"messages[{i}].tool_call_id",
                                 f"{message.get('tool_call_id')!r} names no earlier assistant tool call")
            author = Author.new(Role.TOOL, f"{FUNCTIONS_NAMESPACE}.{name}")
            out.append(Message.from_author_and_content(author, content).with_channel("commentary")
                       .with_recipient("assistant"))
        else:
            raise FieldError(f"messages[{i}].role", f"{role!r} is not one of system, developer, user, assistant, tool")
    return out


def render_prompt(encoding: Any, messages: Sequence[dict[str, Any]], functions: Sequence[FunctionSpec],
                  reasoning_effort: str | None = None, start_date: str | None = None) -> list[int]:
    """The prompt's token ids, ending where the assistant's next message begins."""
    from openai_harmony import Conversation, Role

    conversation = Conversation.from_messages(harmony_messages(messages, functions, reasoning_effort, start_date))
    return list(encoding.render_conversation_for_completion(conversation, Role.ASSISTANT))
