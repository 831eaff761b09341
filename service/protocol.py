"""Conversions between the wire messages and the engine's plain values."""
from __future__ import annotations

import dataclasses

from engine import ModelInfo, RequestOutput, SamplingParams
from service.pb import inference_pb2 as pb


def sampling_params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Build validated SamplingParams; ValueError names the bad field."""
    kwargs: dict[str, object] = {
        "min_tokens": msg.min_tokens, "stop": list(msg.stop), "stop_token_ids": list(msg.stop_token_ids),
        "ignore_eos": msg.ignore_eos, "presence_penalty": msg.presence_penalty,
        "frequency_penalty": msg.frequency_penalty,
    }
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "repetition_penalty",
                 "logprobs", "skip_special_tokens"):
        if msg.HasField(name):
            kwargs[name] = getattr(msg, name)
    if msg.HasField("max_tokens") and msg.max_tokens == 0:
        raise ValueError("max_tokens must be >= 1, got 0")
    return SamplingParams(**kwargs)


def messages_from_proto(msg: pb.Messages) -> list[dict[str, str]]:
    if not msg.messages:
        raise ValueError("messages: must not be empty")
    return [{"role": m.role, "content": m.content} for m in msg.messages]


def response_from_output(out: RequestOutput, request_id: str) -> pb.GenerateResponse:
    """request_id: the client's (the output carries the engine's)."""
    resp = pb.GenerateResponse(request_id=request_id, token_ids=out.new_token_ids, text=out.new_text)
    if out.new_logprobs:
        for token_id, entry in zip(out.new_token_ids, out.new_logprobs, strict=True):
            top = [pb.TokenLogprob(token_id=t, logprob=v) for t, v in entry.items()]
            resp.logprobs.append(pb.Logprobs(chosen=pb.TokenLogprob(token_id=token_id, logprob=entry[token_id]),
                                             top=top))
    if out.is_finished:
        resp.finish_reason = out.finish_reason
        if out.stop_reason is not None:
            resp.stop_reason = str(out.stop_reason)
        cached = out.metrics.num_cached_tokens if out.metrics is not None else 0
        resp.usage.CopyFrom(pb.Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens,
                                     cached_prompt_tokens=cached))
    return resp


def model_info_to_proto(info: ModelInfo) -> pb.ModelInfo:
    return pb.ModelInfo(**dataclasses.asdict(info))
