"""The Responses API's bodies: the request (validated by pydantic), its input items as chat
messages, and the response built from a parsed answer, with its stream of semantic events
(response.created ... response.output_text.delta ... response.completed)."""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine import FieldError
from service.chat.harmony_prompt import REASONING_EFFORTS
from service.chat.output import ChoiceDelta
from service.openai.tool_protocol import FlatToolIn, ToolChoiceIn

_TEXT_PARTS = ("input_text", "output_text", "text")


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: str = "text"
    name: str = ""
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: TextFormat | None = None


class ReasoningOptions(BaseModel):
    """OpenAI's reasoning options; effort "none" turns thinking off (the template's
    enable_thinking), any other effort asks for it (how much is the model's own)."""
    model_config = ConfigDict(extra="ignore")

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FlatToolIn] | None = None
    tool_choice: str | ToolChoiceIn | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None  # not OpenAI's (as chat's extras): reproducible sampling
    logit_bias: dict[str, float] | None = None  # not OpenAI's: token id -> bias, as in chat
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # not OpenAI's: vLLM's chat extra, as in chat
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    # OpenAI's fields this server does not act on are validated as OpenAI does, and refused unless
    # they ask for what is done anyway; unknown names are ignored, as chat completions ignores them.
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None

    def check_unserved(self) -> None:
        if self.truncation == "auto":
            raise FieldError("truncation", "only 'disabled' is served (an input that does not fit the context is "
                             "refused, never cut)")
        if self.background:
            raise FieldError("background", "background responses are not served")

    def template_kwargs(self) -> dict[str, Any] | None:
        """chat_template_kwargs with reasoning.effort as enable_thinking (the two must agree), and
        as reasoning_effort where it is one gpt-oss knows (low, medium, high: its template's and
        Harmony's variable)."""
        kwargs = dict(self.chat_template_kwargs or {})
        effort = self.reasoning.effort if self.reasoning is not None else None
        if effort is not None:
            thinking = effort != "none"
            if kwargs.get("enable_thinking", thinking) != thinking:
                raise FieldError("reasoning.effort", f"{effort!r} contradicts chat_template_kwargs.enable_thinking")
            kwargs["enable_thinking"] = thinking
            if effort in REASONING_EFFORTS:
                kwargs.setdefault("reasoning_effort", effort)
        return kwargs or None

    def chat_body(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """The equivalent chat request's fields (sampling and response format)."""
        body: dict[str, Any] = {"messages": messages or [{"role": "user", "content": ""}],
                                "max_tokens": self.max_output_tokens, "temperature": self.temperature,
                                "top_p": self.top_p, "seed": self.seed, "logit_bias": self.logit_bias}
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise FieldError("text.format.schema", "is required for json_schema")
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.name,
                                                                              "schema": fmt.json_schema}}
        elif fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type != "text":
            raise FieldError("text.format.type", f"{fmt.type!r} is not one of text, json_schema, json_object")
        return {k: v for k, v in body.items() if v is not None}


def _text_of(content: Any, field: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FieldError(field, "a string or a list of text parts")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise FieldError(f"{field}[{j}]", f"only text parts are supported, got {kind!r}")
        parts.append(part["text"])
    return "".join(parts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: messages, function_call (joined into an assistant message's
    tool_calls), function_call_output (a tool message), reasoning (the reasoning_content of the
    assistant message it opens, for templates that replay thinking: Qwen3's)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise FieldError(f"input[{i}].role", f"{role!r} is not one of user, system, developer, assistant")
            content = _text_of(item.get("content", ""), f"input[{i}].content")
            if role == "assistant" and _is_thought_alone(out):
                out[-1]["content"] = content  # the thinking, then what was said
            else:
                out.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                raise FieldError(f"input[{i}]", "a function_call needs name and call_id")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
            if out and out[-1]["role"] == "assistant":  # what the assistant said, then its calls
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            if not isinstance(item.get("call_id"), str):
                raise FieldError(f"input[{i}].call_id", "is required")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind == "reasoning":
            text = _reasoning_text(item, f"input[{i}]")
            if text:
                out.append({"role": "assistant", "content": "", "reasoning_content": text})
        else:
            raise FieldError(f"input[{i}].type", f"{kind!r} is not one of message, function_call, "
                             "function_call_output, reasoning")
    return out


def _is_thought_alone(out: list[dict[str, Any]]) -> bool:
    """The last message is an assistant's thinking with nothing said or called after it yet."""
    last = out[-1] if out else {}
    return last.get("role") == "assistant" and "reasoning_content" in last and not last["content"] \
        and not last.get("tool_calls")


def _reasoning_text(item: dict[str, Any], field: str) -> str:
    """A reasoning item's text: its reasoning_text parts (as this server writes them), else its
    summary's text (as OpenAI's are returned)."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                  for p in parts):
            raise FieldError(f"{field}.{key}", f"a list of {kind} parts")
        if parts:
            return "".join(p["text"] for p in parts)
    return ""


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a follow-up replays."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in output:
        if item["type"] == "reasoning":
            message["reasoning_content"] = "".join(p["text"] for p in item["content"])
        elif item["type"] == "message":
            message["content"] += "".join(p["text"] for p in item["content"])
        elif item["type"] == "function_call":
            message.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": item["arguments"]}})
    return [message]


class ResponseBuilder:
    """Output items grown from parsed deltas, with the events that announce them."""

    def __init__(self, response_id: str, base: dict[str, Any]) -> None:
        self.id, self.base = response_id, base
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._sequence = 0

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def response(self, status: str, usage: dict[str, Any] | None = None,
                 incomplete: str | None = None) -> dict[str, Any]:
        return {**self.base, "id": self.id, "status": status, "output": self.output, "usage": usage,
                "incomplete_details": {"reason": incomplete} if incomplete else None}

    def _item(self, kind: str, item: dict[str, Any]) -> list[str]:
        events = self.close()
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        item = {"id": f"{prefix}_{uuid.uuid4().hex}", "type": kind, **item}
        self.output.append(item)
        self._open = item
        events.append(self.event("response.output_item.added", output_index=len(self.output) - 1,
                                 item=_in_progress(item)))
        if kind == "message":
            events.append(self.event("response.content_part.added", item_id=item["id"],
                                     output_index=len(self.output) - 1, content_index=0,
                                     part={"type": "output_text", "text": "", "annotations": []}))
        return events

    def add(self, delta: ChoiceDelta) -> list[str]:
        events: list[str] = []
        index = lambda: len(self.output) - 1  # noqa: E731 - the open item's index, after _item
        if delta.reasoning:
            if self._open is None or self._open["type"] != "reasoning":
                events += self._item("reasoning", {"summary": [], "content": [{"type": "reasoning_text", "text": ""}]})
            self._open["content"][0]["text"] += delta.reasoning
            events.append(self.event("response.reasoning_text.delta", item_id=self._open["id"], output_index=index(),
                                     content_index=0, delta=delta.reasoning))
        for piece in delta.pieces:  # in the answer's order: text after a call is a message after it
            if piece.content:
                if self._open is None or self._open["type"] != "message":
                    events += self._item("message", {"role": "assistant", "status": "completed", "content": [
                        {"type": "output_text", "text": "", "annotations": [], "logprobs": []}]})
                self._open["content"][0]["text"] += piece.content
                events.append(self.event("response.output_text.delta", item_id=self._open["id"],
                                         output_index=index(), content_index=0, delta=piece.content, logprobs=[]))
            for call in piece.calls:
                if call.id is not None:
                    events += self._item("function_call", {"call_id": call.id, "name": call.name, "arguments": "",
                                                           "status": "completed"})
                if call.arguments:
                    self._open["arguments"] += call.arguments
                    events.append(self.event("response.function_call_arguments.delta", item_id=self._open["id"],
                                             output_index=index(), delta=call.arguments))
        return events

    def close(self, is_cut: bool = False) -> list[str]:
        """The open item's closing events (is_cut: the answer stopped inside it: incomplete; a
        function_call is always whole: a cut call's text is a message)."""
        item, self._open = self._open, None
        if item is None:
            return []
        if is_cut and "status" in item and item["type"] != "function_call":
            item["status"] = "incomplete"
        index, events = self.output.index(item), []
        if item["type"] == "reasoning":
            events.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=item["content"][0]["text"]))
        elif item["type"] == "message":
            part = item["content"][0]
            events.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=part["text"], logprobs=[]))
            events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                     content_index=0, part=part))
        else:
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=index, name=item["name"], arguments=item["arguments"]))
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events


def _in_progress(item: dict[str, Any]) -> dict[str, Any]:
    item = json.loads(json.dumps(item))
    if item["type"] == "message":
        item["content"] = []
    if "status" in item:
        item["status"] = "in_progress"
    return item


def response_base(request: ResponsesRequest, model: str, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The response object's fields that echo the request."""
    choice = request.tool_choice
    fmt = request.text.format.model_dump(by_alias=True, exclude_none=True) if request.text and request.text.format \
        else {"type": "text"}
    return {"object": "response", "created_at": int(time.time()), "model": model, "error": None,
            "instructions": request.instructions, "metadata": request.metadata or {},
            "tools": tools, "tool_choice": choice.model_dump(exclude_none=True) if isinstance(choice, BaseModel)
            else (choice or "auto"), "parallel_tool_calls": request.parallel_tool_calls is not False,
            "temperature": request.temperature, "top_p": request.top_p,
            "max_output_tokens": request.max_output_tokens, "previous_response_id": request.previous_response_id,
            "store": request.store, "text": {"format": fmt}, "reasoning": request.reasoning.model_dump() if request.reasoning is not None else None, "truncation": "disabled",
            "user": request.user}
