"""Conversions between vLLM's engine gRPC contract (`vllm.grpc.engine`, from the pinned
smg-grpc-proto package) and the engine's plain values, with vLLM's servicer's conventions:
unset or zero fields mean vLLM's defaults, a stream sends one chunk per output and then a
`complete` per finished sample, a unary call one `complete` per sample."""
from __future__ import annotations

import datetime
import itertools
from types import MappingProxyType

from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from engine import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvCacheEvent,
    RequestOutput,
    SamplingParams,
)
from service.grpc.sampling import SamplingMessage, sampling_params_from_message

_U64 = 1 << 64


# As vLLM's servicer reads the message: temperature unset is 1.0, top_p and repetition_penalty 0
# are 1.0 (off), n 0 is 1, max_tokens unset runs to the context's end; the mapping's own errors
# name their fields inside the request's sampling_params.
SAMPLING = SamplingMessage(
    constraint="constraint", unset=MappingProxyType({"temperature": 1.0, "max_tokens": None}),
    zero=MappingProxyType({"top_p": 1.0, "repetition_penalty": 1.0, "n": 1}), refused=frozenset({"structural_tag"}),
    names=MappingProxyType({"max_tokens": "sampling_params.max_tokens",
                            "structural_tag": "sampling_params.structural_tag"}))


def sampling_params_from_vllm(msg: vpb.SamplingParams) -> SamplingParams:
    """Validated SamplingParams; FieldError names the bad field."""
    return sampling_params_from_message(msg, SAMPLING)


def _top(entry: dict[int, float] | None, num_top: int | None) -> vpb.TopLogProbs:
    """vLLM's top list: the entry's first num_top items (the sampled token, then by rank)."""
    top = vpb.TopLogProbs()
    if num_top and entry:
        for token_id, value in itertools.islice(entry.items(), num_top):
            top.token_ids.append(token_id)
            top.values.append(value)
    return top


def output_logprobs(token_ids: list[int], entries: list[dict[int, float]] | None, num_top: int | None
                    ) -> vpb.OutputLogProbs | None:
    if not entries:
        return None
    msg = vpb.OutputLogProbs()
    for token_id, entry in zip(token_ids, entries, strict=True):
        msg.token_ids.append(token_id)
        msg.token_logprobs.append(entry[token_id])
        if num_top:
            msg.top_logprobs.append(_top(entry, num_top))
    return msg


def input_logprobs(out: RequestOutput, num_top: int | None) -> vpb.InputLogProbs | None:
    """Prompt logprobs (the first token has none), as the first message of a sample carries them."""
    if not out.prompt_logprobs:
        return None
    msg = vpb.InputLogProbs()
    for token_id, entry in zip(out.prompt_token_ids, out.prompt_logprobs, strict=True):
        value = vpb.InputTokenLogProb()
        if entry is not None and token_id in entry:
            value.value = entry[token_id]
        msg.token_logprobs.append(value)
        msg.token_ids.append(token_id)
        if num_top:
            msg.top_logprobs.append(_top(entry, num_top))
    return msg


def chunk_response(out: RequestOutput, params: SamplingParams, is_first: bool) -> vpb.GenerateResponse:
    """One streamed delta of one sample (cached_tokens is known once the request finishes)."""
    return vpb.GenerateResponse(chunk=vpb.GenerateStreamChunk(
        token_ids=out.new_token_ids, prompt_tokens=out.num_prompt_tokens, completion_tokens=len(out.new_token_ids),
        cached_tokens=out.num_cached_tokens,
        output_logprobs=output_logprobs(out.new_token_ids, out.new_logprobs, params.logprobs),
        input_logprobs=input_logprobs(out, params.prompt_logprobs) if is_first else None, index=out.index))


def complete_response(out: RequestOutput, params: SamplingParams, is_stream: bool) -> vpb.GenerateResponse:
    """A finished sample. Streamed: its last delta (the chunks carried the rest, as vLLM's
    DELTA outputs do); unary: every token it produced."""
    if is_stream:
        token_ids, entries = out.new_token_ids, out.new_logprobs
    else:
        token_ids, entries = out.token_ids, out.logprobs
    msg = vpb.GenerateComplete(
        output_ids=token_ids, finish_reason=out.finish_reason or "stop", prompt_tokens=out.num_prompt_tokens,
        completion_tokens=len(token_ids), cached_tokens=out.num_cached_tokens,
        output_logprobs=output_logprobs(token_ids, entries, params.logprobs),
        input_logprobs=input_logprobs(out, params.prompt_logprobs), index=out.index)
    if out.metrics is not None:  # this sample's speculation: proposals verified and accepted
        msg.spec_draft_tokens = out.metrics.num_draft_tokens
        msg.spec_accepted_tokens = out.metrics.num_accepted_tokens
    if isinstance(out.stop_reason, int):
        msg.matched_token_id = out.stop_reason
    elif out.stop_reason is not None:
        msg.matched_stop_str = out.stop_reason
    return vpb.GenerateResponse(complete=msg)


def to_int64(value: int) -> int:
    """A block hash as the contract's signed 64-bit field."""
    value %= _U64
    return value - _U64 if value >= 1 << 63 else value


def kv_event_to_proto(event: KvCacheEvent, event_id: int) -> common_pb2.KvCacheEvent:
    if isinstance(event, BlockStored):
        bs = event.block_size
        blocks = [common_pb2.KvBlock(block_hash=to_int64(h), token_ids=event.token_ids[i * bs:(i + 1) * bs],
                                     block_size=bs) for i, h in enumerate(event.block_hashes)]
        stored = common_pb2.KvBlocksStored(blocks=blocks, tier=common_pb2.KV_CACHE_TIER_DEVICE,
                                           locality=common_pb2.KV_CACHE_LOCALITY_LOCAL)
        if event.parent_block_hash is not None:
            stored.parent_block_hash = to_int64(event.parent_block_hash)
        return common_pb2.KvCacheEvent(event_id=event_id, stored=stored)
    if isinstance(event, BlockRemoved):
        return common_pb2.KvCacheEvent(event_id=event_id, removed=common_pb2.KvBlocksRemoved(
            block_hashes=[to_int64(h) for h in event.block_hashes], tier=common_pb2.KV_CACHE_TIER_DEVICE,
            locality=common_pb2.KV_CACHE_LOCALITY_LOCAL))
    if isinstance(event, AllBlocksCleared):
        return common_pb2.KvCacheEvent(event_id=event_id, cleared=common_pb2.KvCacheCleared())
    raise TypeError(f"not a KV cache event: {event!r}")


def iso_timestamp() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat()
