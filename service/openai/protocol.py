"""The OpenAI-compatible HTTP API's bodies (validated by pydantic) and their mapping to the engine.

Request fields follow the OpenAI API (plus vLLM's usual extras: top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, skip_special_tokens). Unknown fields
are ignored, as OpenAI-compatible servers do, so SDK additions do not break clients; known fields
that minivllm cannot honour yet (suffix, best_of, ...) are refused with a 400 naming
the field rather than silently ignored. Tools: service/openai/tool_protocol.py.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine import FieldError, RequestOutput, SamplingParams, StructuredOutput
from service.chat.tools import ToolRequest
from service.openai.tool_protocol import ChatToolIn, ToolCallIn, ToolChoiceIn, tool_request

FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "stop"}
MAX_PROMPTS = 128  # a completions batch's prompts: one call fans out to at most this many requests


class UnsupportedFieldError(FieldError):
    """A field of the OpenAI request this server refuses (or not in this form)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(param, message)

    @property
    def param(self) -> str:
        """The field, as OpenAI's error body calls it."""
        return self.field


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = ""
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    json_schema: JsonSchemaFormat | None = None

    def structured(self) -> StructuredOutput | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput("json_object")
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.json_schema is None:
                raise UnsupportedFieldError("response_format.json_schema", "needs a schema")
            return StructuredOutput("json_schema", json.dumps(self.json_schema.json_schema))
        raise UnsupportedFieldError("response_format", f"type {self.type!r} is not one of text, json_object, "
                                                       "json_schema")


class _SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # vLLM's extras, same names.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None  # OpenAI: token id (as a string) -> bias
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    prompt_logprobs: int | None = Field(default=None, ge=0)
    # vLLM's structured-output extras: structured_outputs {json|regex|choice|grammar} and the
    # older guided_* names.
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # OpenAI's chat field; vLLM's completions take it too.
    response_format: ResponseFormat | None = None

    def _structured(self) -> StructuredOutput | None:
        specs: list[tuple[str, Any]] = []
        # Validated first, so a bad type is named even beside another constraint.
        response_format = self.response_format.structured() if self.response_format is not None else None
        if response_format is not None:
            specs.append(("response_format", response_format))
        for key, value in (self.structured_outputs or {}).items():
            if value is not None and value is not False:
                specs.append((f"structured_outputs.{key}", value))
        for key in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if getattr(self, key) is not None:
                specs.append((key, getattr(self, key)))
        if not specs:
            return None
        if len(specs) > 1:
            raise UnsupportedFieldError(specs[1][0], f"only one structured-output constraint at a time, also got "
                                                     f"{specs[0][0]}")
        name, value = specs[0]
        if isinstance(value, StructuredOutput):
            return value
        kind = name.rsplit(".", 1)[-1].removeprefix("guided_")
        try:
            if kind == "json":
                if isinstance(value, dict) and not value:
                    return StructuredOutput("json_object")
                return StructuredOutput("json_schema", value if isinstance(value, str) else json.dumps(value))
            if kind == "json_object":
                return StructuredOutput("json_object")
            if kind == "choice":
                return StructuredOutput.choice(value)
            if kind in ("regex", "grammar"):
                return StructuredOutput(kind, value)
        except ValueError as exc:
            raise UnsupportedFieldError(name, str(exc)) from None
        raise UnsupportedFieldError(name, "unknown structured-output kind")

    def _common(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        kwargs: dict[str, Any] = {
            "n": self.n,
            "max_tokens": max_tokens, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "min_tokens": self.min_tokens, "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens, "logprobs": logprobs,
            "stop": [self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            "stop_token_ids": list(self.stop_token_ids or []),
        }
        for name in ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "truncate_prompt_tokens",
                     "prompt_logprobs"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        if self.logit_bias:
            try:
                kwargs["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError:
                raise UnsupportedFieldError("logit_bias", "keys must be token ids") from None
        kwargs["include_stop_str_in_output"] = self.include_stop_str_in_output
        kwargs["structured_output"] = self._structured()
        return SamplingParams(**kwargs)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompt_inputs(self) -> list[str | list[int]]:
        """The prompts: one text or token-id list, or a batch of either (each its own engine
        request; choice i * n + j is sample j of prompt i, as OpenAI and vLLM number them)."""
        prompt = self.prompt
        prompts = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        if len(prompts) > MAX_PROMPTS:
            raise UnsupportedFieldError("prompt", f"a batch of {len(prompts)} prompts, at most {MAX_PROMPTS}")
        empty = [i for i, p in enumerate(prompts) if not p]  # [] wraps to [[]]: prompts is never empty
        if empty:
            raise UnsupportedFieldError(f"prompt[{empty[0]}]" if len(prompts) > 1 else "prompt", "must not be empty")
        return prompts

    def sampling_params(self, default_max_tokens: int = 16) -> SamplingParams:
        if self.suffix:
            raise UnsupportedFieldError("suffix", "is not supported")
        if self.best_of not in (None, 1):
            raise UnsupportedFieldError("best_of", "only 1 is supported")
        # OpenAI's completions default to 16 tokens.
        params = self._common(self.max_tokens or default_max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None:
            # The echoed prompt's tokens carry logprobs too (lm-evaluation-harness scores a text so).
            params.prompt_logprobs = max(params.prompt_logprobs or 0, self.logprobs)
        return params


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's calls
    # An assistant's earlier thinking (vLLM's names), for templates that replay it (Qwen3's).
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_call_id: str | None = None  # a tool result's call
    name: str | None = None


def chat_messages(messages: list[ChatMessageIn]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: text parts joined, other parts refused; an
    assistant's tool_calls and a tool result's tool_call_id kept (developer is system)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.role == "tool" and not m.tool_call_id:  # a result must say which call it answers
            raise UnsupportedFieldError(f"messages[{i}].tool_call_id", "is required for a tool message")
        if isinstance(m.content, list):
            parts = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise UnsupportedFieldError(f"messages[{i}].content[{j}]",
                                                f"only text parts are supported, got {part.type!r}")
                parts.append(part.text)
            content = "".join(parts)
        else:
            content = m.content or ""
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                     for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        thinking = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if thinking is not None and m.role == "assistant":
            message["reasoning_content"] = thinking
        if m.name is not None and m.role == "tool":
            message["name"] = m.name
        out.append(message)
    return out


class TokenizeRequest(BaseModel):
    """vLLM's POST /tokenize: a prompt or a chat, tokenized exactly as generation would."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool = True  # a prompt's BOS and the like, where the tokenizer adds them
    return_token_strs: bool = False
    # A chat's tools and template variables, as vLLM's chat tokenize takes them: the prompt is then
    # the one a chat completion with them would get (the template's tools, or the generic format).
    tools: list[ChatToolIn] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def tool_request(self) -> ToolRequest:
        return tool_request(self.tools, None, None)

    def chat(self) -> list[dict[str, Any]] | None:
        if (self.prompt is None) == (self.messages is None):
            raise UnsupportedFieldError("prompt", "give exactly one of prompt or messages")
        if self.messages is not None and not self.messages:
            raise UnsupportedFieldError("messages", "must not be empty")
        return chat_messages(self.messages) if self.messages is not None else None


class DetokenizeRequest(BaseModel):
    """vLLM's POST /detokenize: token ids back to text."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ChatToolIn] | None = None
    tool_choice: str | ToolChoiceIn | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra template variables (enable_thinking, ...)

    def chat_messages(self) -> list[dict[str, Any]]:
        return chat_messages(self.messages)

    def tool_request(self) -> ToolRequest:
        return tool_request(self.tools, self.tool_choice, self.parallel_tool_calls)

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs and not self.logprobs:
            raise UnsupportedFieldError("top_logprobs", "needs logprobs: true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._common(self.max_completion_tokens or self.max_tokens, logprobs)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _is_type_tag(part: str) -> bool:
    """A union member pydantic names in an error's location ("str", "list[int]", "ContentPart"),
    not a field: our fields are snake_case names."""
    return "[" in part or part in ("str", "int", "float", "bool", "none") or part[:1].isupper()


def field_path(loc: tuple | list) -> str | None:
    """A pydantic error's location as the field's name, as our own errors write it:
    ("body", "messages", 0, "role") -> "messages[0].role"."""
    path = ""
    for part in loc:
        if part == "body" and not path or isinstance(part, str) and _is_type_tag(part):
            continue
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or None


def validation_field_error(exc: ValidationError) -> UnsupportedFieldError:
    """A pydantic error as the field error of its first problem's field."""
    first = exc.errors()[0] if exc.errors() else {}
    return UnsupportedFieldError(field_path(first.get("loc", ())) or "", first.get("msg", "invalid"))


def usage_body(outs: list[RequestOutput], num_reasoning_tokens: int | None = None) -> dict[str, Any]:
    """Usage of a call from its samples' final outputs: each prompt once (its samples share a
    request id), every sample's tokens (and of those, the thinking ones when a reasoning parser
    counted them)."""
    prompts = {o.request_id: o for o in outs}.values()
    prompt = sum(o.num_prompt_tokens for o in prompts)
    completion = sum(o.num_output_tokens for o in outs)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
             "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in prompts)}}
    if num_reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": num_reasoning_tokens}
    return usage


def finish_reason(out: RequestOutput) -> str | None:
    return FINISH_REASONS.get(out.finish_reason) if out.finish_reason else None


def ranked(entry: dict[int, float], top_n: int | None = None) -> list[tuple[int, float]]:
    """(token id, logprob) pairs of one position's entry, most likely first (the top_n of them)."""
    return sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:top_n]


class ChoiceLogprobs:
    """Logprob entries for one chunk, in the chat or the completions layout."""

    @staticmethod
    def ids(out: RequestOutput, top_n: int) -> list[int]:
        """Every token id whose text the layout needs (chosen and top alternatives)."""
        ids: list[int] = []
        for token_id, entry in zip(out.new_token_ids, out.new_logprobs or [], strict=False):
            ids.append(token_id)
            ids.extend(t for t, _ in ranked(entry, top_n))
        return ids

    @staticmethod
    def chat(out: RequestOutput, top_n: int, text: dict[int, str]) -> dict[str, Any]:
        content = []
        for token_id, entry in zip(out.new_token_ids, out.new_logprobs or [], strict=False):
            content.append({
                "token": text[token_id], "logprob": entry[token_id], "bytes": list(text[token_id].encode()),
                "top_logprobs": [{"token": text[t], "logprob": v, "bytes": list(text[t].encode())}
                                 for t, v in ranked(entry, top_n)]})
        return {"content": content}

    @staticmethod
    def completion(token_ids: list[int], entries: list[dict[int, float] | None], top_n: int, text: dict[int, str],
                   offset: int = 0) -> dict[str, list[Any]]:
        """The completions layout: entries[i] scores token_ids[i] (None where a prompt's first token
        has no logprob); offsets run over the tokens' own texts from offset."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, entries, strict=False):
            tokens.append(text[token_id])
            token_logprobs.append(entry[token_id] if entry is not None else None)
            top_logprobs.append({text[t]: v for t, v in ranked(entry, top_n)} if entry is not None else None)
            offsets.append(offset)
            offset += len(text[token_id])
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}


@dataclass(frozen=True, slots=True)
class EchoedPrompt:
    """The prompt an echoing completion starts with, and with logprobs its tokens' (the completions
    layout: a None where the first token has no logprob)."""

    text: str
    logprobs: dict[str, list[Any]] | None = None


def now() -> int:
    return int(time.time())
