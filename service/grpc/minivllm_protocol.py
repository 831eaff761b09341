"""Conversions between the wire messages and the engine's plain values."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from engine import FieldError, LimitExceededError, ModelInfo, PoolingParams, RequestOutput, SamplingParams
from service.chat.output import ChoiceOutput
from service.chat.tool_grammar import FunctionSpec
from service.chat.tool_schema import parameters_problem
from service.chat.tools import ToolRequest
from service.grpc.sampling import SamplingMessage, sampling_params_from_message
from service.pb import inference_pb2 as pb
from service.score_prompts import MAX_DOCUMENTS, relevance_score
from service.text_check import json_text_unencodable, unencodable_path

# minivllm.v1 marks every field whose zero is a value of its own as optional: unset is the engine's default.
SAMPLING = SamplingMessage(constraint="structured_output")


def sampling_params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Build validated SamplingParams; FieldError names the bad field."""
    return sampling_params_from_message(msg, SAMPLING)


def messages_from_proto(msg: pb.Messages) -> list[dict[str, Any]]:
    if not msg.messages:
        raise FieldError("messages", "must not be empty")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(msg.messages):
        if m.role == "tool" and not m.tool_call_id:  # a result must say which call it answers
            raise FieldError(f"messages[{i}].tool_call_id", "is required for a tool message")
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        for j, call in enumerate(m.tool_calls):  # JSON text: its escapes may spell what protobuf cannot carry
            if json_text_unencodable(call.arguments):
                raise FieldError(f"messages[{i}].tool_calls[{j}].arguments", "is not valid Unicode text: it holds a "
                                 "lone surrogate (such as \\ud800), which cannot be encoded as UTF-8")
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                                                   "arguments": c.arguments or "{}"}}
                                     for c in m.tool_calls]
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def template_kwargs_from_proto(msg: pb.Messages) -> dict[str, Any] | None:
    """The chat's template variables (JSON text on the wire); FieldError naming the field."""
    if not msg.chat_template_kwargs:
        return None
    try:
        kwargs = json.loads(msg.chat_template_kwargs)
    except (ValueError, RecursionError):
        raise FieldError("chat_template_kwargs", "not JSON") from None
    if not isinstance(kwargs, dict):
        raise FieldError("chat_template_kwargs", "must be a JSON object")
    return kwargs


def tools_from_proto(msg: pb.Messages) -> ToolRequest:
    """The chat's tools; FieldError naming the field as the chat planning does (the servicer renames it)."""
    functions = []
    for i, tool in enumerate(msg.tools):
        try:
            parameters = json.loads(tool.parameters) if tool.parameters else None
        except ValueError:
            raise FieldError(f"tools[{i}].parameters", "not JSON") from None
        except RecursionError:  # nested past the interpreter's stack: a 400, not a server error
            raise FieldError(f"tools[{i}].parameters", "JSON nested too deeply") from None
        problem = parameters_problem(parameters) if parameters is not None else None
        if problem is None and parameters is not None and unencodable_path(parameters) is not None:
            problem = "holds text that is not valid Unicode (a lone surrogate such as \\ud800)"
        if problem is not None:
            raise FieldError(f"tools[{i}].parameters", problem)
        functions.append(FunctionSpec(tool.name, tool.description, parameters))
    choice = msg.tool_choice or ("auto" if functions else "none")
    if msg.tool_choice_function:
        choice = msg.tool_choice_function
    request = ToolRequest(functions, choice, bool(msg.tool_choice_function),
                          msg.parallel_tool_calls if msg.HasField("parallel_tool_calls") else True)
    request.check()
    return request


def logprob_token_ids(out: RequestOutput) -> list[int]:
    """Every token id a response's logprobs name (their texts go with them)."""
    ids = {t for entry in out.new_logprobs or () for t in entry}
    ids.update(t for entry in out.prompt_logprobs or () if entry for t in entry)
    return sorted(ids)


def _logprobs(chosen_id: int, entry: dict[int, float], texts: dict[int, str]) -> pb.Logprobs:
    top = [pb.TokenLogprob(token_id=t, logprob=v, token=texts.get(t, "")) for t, v in entry.items()]
    return pb.Logprobs(chosen=pb.TokenLogprob(token_id=chosen_id, logprob=entry[chosen_id],
                                              token=texts.get(chosen_id, "")), top=top)


def response_from_output(out: RequestOutput, request_id: str, texts: dict[int, str] | None = None,
                         num_completion_tokens: int | None = None) -> pb.GenerateResponse:
    """request_id: the client's (the output carries the engine's); texts: token id -> text for
    the logprobs (logprob_token_ids); num_completion_tokens: given on the request's last
    message, the tokens of all its samples (the usage counts the prompt once)."""
    texts = texts or {}
    resp = pb.GenerateResponse(request_id=request_id, token_ids=out.new_token_ids, text=out.new_text,
                               index=out.index)
    if out.new_logprobs:
        for token_id, entry in zip(out.new_token_ids, out.new_logprobs, strict=True):
            resp.logprobs.append(_logprobs(token_id, entry, texts))
    if out.prompt_logprobs:
        prompt = out.prompt_token_ids
        for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
            resp.prompt_logprobs.append(_logprobs(prompt[position], entry, texts))
    if out.is_finished:
        resp.finish_reason = out.finish_reason
        if out.stop_reason is not None:
            resp.stop_reason = str(out.stop_reason)
    if num_completion_tokens is not None:
        resp.usage.CopyFrom(pb.Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=num_completion_tokens,
                                     cached_prompt_tokens=out.num_cached_tokens))
    return resp


def add_parsed(response: pb.GenerateResponse, out: RequestOutput, parsed: list[ChoiceOutput], is_last: bool) -> None:
    """A chat answer's parse on its response: text is content only, thinking and calls in their
    fields, tool_calls as the finish reason of a sample that called, reasoning tokens in usage."""
    output = parsed[out.index]
    delta = output.feed(out)
    response.text = delta.parsed.content
    response.reasoning_text = delta.reasoning
    for call in delta.parsed.calls:
        response.tool_calls.append(pb.ToolCallDelta(index=call.index, id=call.id or "", name=call.name or "",
                                                    arguments=call.arguments))
    if out.is_finished:
        response.finish_reason = output.finish_reason(out.finish_reason) or ""
    if is_last:
        response.usage.reasoning_tokens = sum(p.num_reasoning_tokens for p in parsed)


def model_info_to_proto(info: ModelInfo) -> pb.ModelInfo:
    # the message's fields only: the engine's local paths (model_dir, ...) stay on this side
    fields = pb.ModelInfo.DESCRIPTOR.fields_by_name
    return pb.ModelInfo(**{k: v for k, v in dataclasses.asdict(info).items() if k in fields})


def embed_inputs_from_proto(msg: pb.EmbedRequest) -> list[str | list[int]]:
    """Each input's prompt text or token ids; FieldError names the input (inputs[i].prompt...)."""
    if not msg.inputs:
        raise FieldError("inputs", "must not be empty")
    prompts: list[str | list[int]] = []
    for i, item in enumerate(msg.inputs):
        kind = item.WhichOneof("input")
        if kind == "prompt":
            prompt: str | list[int] = item.prompt
        elif kind == "prompt_token_ids":
            prompt = list(item.prompt_token_ids.ids)
        else:
            raise FieldError(f"inputs[{i}]", "one of prompt or prompt_token_ids is required")
        if not prompt:
            raise FieldError(f"inputs[{i}].{kind}", "must not be empty")
        prompts.append(prompt)
    return prompts


def embed_input_field(msg: pb.EmbedRequest, index: int) -> str:
    """Where input index's prompt is, as the engine's prompt errors are renamed to."""
    return f"inputs[{index}].{msg.inputs[index].WhichOneof('input')}"


def pooling_params_from_proto(msg: pb.EmbedRequest) -> PoolingParams:
    """Zero and empty fields are the model's defaults; FieldError names a bad field."""
    return PoolingParams(pooling_type=msg.pooling_type or None,
                         normalize=msg.normalize if msg.HasField("normalize") else None,
                         dimensions=msg.dimensions or None)


def score_pairs_from_proto(msg: pb.ScoreRequest) -> list[tuple[str, str]]:
    """The query against each document, in order; FieldError names a bad field."""
    if not msg.query:
        raise FieldError("query", "must not be empty")
    if not msg.documents:
        raise FieldError("documents", "must not be empty")
    if len(msg.documents) > MAX_DOCUMENTS:
        raise LimitExceededError("documents", f"{len(msg.documents)} documents, at most {MAX_DOCUMENTS}")
    empty = next((i for i, document in enumerate(msg.documents) if not document), None)
    if empty is not None:
        raise FieldError(f"documents[{empty}]", "must not be empty")
    return [(msg.query, document) for document in msg.documents]


def score_response(request_id: str, outputs: list[RequestOutput]) -> pb.ScoreResponse:
    return pb.ScoreResponse(request_id=request_id, scores=[relevance_score(out.scores) for out in outputs],
                            usage=pb.Usage(prompt_tokens=sum(len(out.prompt_token_ids) for out in outputs)))


def embed_response(request_id: str, outputs: list[RequestOutput]) -> pb.EmbedResponse:
    return pb.EmbedResponse(request_id=request_id,
                            embeddings=[pb.Embedding(values=out.embedding) for out in outputs],
                            usage=pb.Usage(prompt_tokens=sum(len(out.prompt_token_ids) for out in outputs)))
