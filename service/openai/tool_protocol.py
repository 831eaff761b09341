"""Tool bodies of the OpenAI API (validated by pydantic): chat's nested function tools and the
Responses API's flat ones, tool_choice in both shapes, and calls in an assistant's history;
all mapped to one ToolRequest."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from engine import FieldError
from service.chat.tool_grammar import FunctionSpec
from service.chat.tool_schema import parameters_problem
from service.chat.tools import ToolRequest


class FunctionIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatToolIn(BaseModel):
    """Chat: {"type": "function", "function": {...}}."""
    model_config = ConfigDict(extra="ignore")

    type: str = "function"
    function: FunctionIn | None = None


class FlatToolIn(BaseModel):
    """Responses: {"type": "function", "name": ..., "parameters": ...}."""
    model_config = ConfigDict(extra="ignore")

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str


class ToolChoiceIn(BaseModel):
    """{"type": "function", "function": {"name": ...}} (chat) or {"type": "function", "name": ...}."""
    model_config = ConfigDict(extra="ignore")

    type: str = "function"
    function: NamedFunction | None = None
    name: str | None = None


class FunctionCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str = "{}"


class ToolCallIn(BaseModel):
    """A call in an assistant message of the history."""
    model_config = ConfigDict(extra="ignore")

    id: str = ""
    type: str = "function"
    function: FunctionCallIn


def tool_request(tools: list[ChatToolIn] | list[FlatToolIn] | None, tool_choice: str | ToolChoiceIn | None,
                 parallel: bool | None) -> ToolRequest:
    """The request's tools; FieldError naming the field for a kind of tool that is not served."""
    functions = []
    for i, tool in enumerate(tools or []):
        if tool.type != "function":
            raise FieldError(f"tools[{i}].type", f"only function tools are supported, got {tool.type!r}")
        spec = tool.function if isinstance(tool, ChatToolIn) else tool
        if spec is None:
            raise FieldError(f"tools[{i}].function", "is required")
        if spec.name is None:
            raise FieldError(f"tools[{i}].name", "is required")
        problem = parameters_problem(spec.parameters) if spec.parameters is not None else None
        if problem is not None:  # chat's tools nest the function; the Responses API's are flat
            where = f"tools[{i}].function" if isinstance(tool, ChatToolIn) else f"tools[{i}]"
            raise FieldError(f"{where}.parameters", problem)
        functions.append(FunctionSpec(spec.name, spec.description or "", spec.parameters, spec.strict))
    choice, is_named = "auto" if functions else "none", False
    if isinstance(tool_choice, str):
        choice = tool_choice
    elif tool_choice is not None:
        if tool_choice.type != "function":
            raise FieldError("tool_choice.type", f"only function is supported, got {tool_choice.type!r}")
        name = tool_choice.function.name if tool_choice.function is not None else tool_choice.name
        if not name:
            raise FieldError("tool_choice", "a named choice needs the function's name")
        choice, is_named = name, True
    request = ToolRequest(functions, choice, is_named, True if parallel is None else parallel)
    request.check()
    return request
