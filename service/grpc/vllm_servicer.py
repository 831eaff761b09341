"""vLLM's engine gRPC contract (`vllm.grpc.engine.VllmEngine`, from the pinned smg-grpc-proto
package), served beside `minivllm.v1.Inference` on the same server: what a gateway such as SMG
speaks to a vLLM worker (`vllm serve --grpc`). The gateway tokenizes, applies chat templates and
parses tool calls itself; this service takes token ids (or text), streams token ids back, and
answers the gateway's probes (HealthCheck, GetModelInfo, GetServerInfo, GetTokenizer), its load
polls (GetLoads) and its prefix-cache subscription (SubscribeKvEvents) as vLLM's servicer does.
Admission, limits, auth, drain, metrics (protocol "grpc-vllm") and traces are the other doors'.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from engine import FieldError, RequestOutput, SamplingParams
from service.async_engine import AsyncEngine, EngineDeadError
from service.grpc.generate_stream import Admitted, GenerateIds, call_info, generate_stream
from service.grpc.kv_event_hub import KvEventHub
from service.grpc.status import serving_engine
from service.grpc.vllm_protocol import chunk_response, complete_response, iso_timestamp, sampling_params_from_vllm
from service.observability.request_observer import RequestObserver
from service.serving_state import EngineUnavailableError, ServingState
from service.tokenizer_bundle import CHUNK_BYTES, build_tokenizer_zip

logger = logging.getLogger(__name__)

VLLM_SERVICE_NAME = vpb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
PROTOCOL = "grpc-vllm"  # the metrics' and traces' name for this door
_MAX_LOAD_WAIT_S = 600.0  # an information call without a deadline waits this long for the model


@dataclasses.dataclass(frozen=True, slots=True)
class ModelFiles:
    """Where the served model's files are (the gateway reads its config and tokenizer)."""

    model: str  # as configured: a directory, a .gguf file or a name
    model_dir: Path
    tokenizer_dir: Path
    served_model_name: str

    def hf_config(self) -> dict[str, Any]:
        path = self.model_dir / "config.json"
        return json.loads(path.read_text()) if path.is_file() else {}


class VllmEngineServicer(vpb_grpc.VllmEngineServicer):
    def __init__(self, state: ServingState, hub: KvEventHub, observer: RequestObserver | None = None) -> None:
        self.state = state
        self.hub = hub
        self.observer = observer or RequestObserver()
        self.files: ModelFiles | None = None  # set by the server once the model has loaded
        self._live: dict[str, str] = {}  # the contract's request id -> engine id, while it runs
        self._start_time = time.time()
        self._last_receive_time = 0.0
        self._tokenizer_zip: tuple[bytes, str] | None = None

    async def _async_engine(self, context: grpc.aio.ServicerContext, for_new_request: bool = False,
                            task: str | None = None) -> AsyncEngine:
        if not for_new_request and self.state.engine is None:
            # vLLM's server listens once its model is loaded; ours listens at once (probes see
            # NOT_SERVING), so a gateway's discovery calls wait for the model instead of failing.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.state.loaded.wait(), context.time_remaining() or _MAX_LOAD_WAIT_S)
        return await serving_engine(self.state, context, for_new_request, task)

    # ---- generation -----------------------------------------------------------------------

    async def Generate(self, request: vpb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[vpb.GenerateResponse]:
        engine = await self._async_engine(context, for_new_request=True, task="generate")
        self._last_receive_time = time.time()
        ids = GenerateIds.of(engine, request.request_id)

        async def admit(params: SamplingParams) -> Admitted[vpb.GenerateResponse]:
            outputs = await engine.generate(ids.request_id, params, prompt=self._prompt(request),
                                            engine_id=ids.engine_id)
            self._live[ids.request_id] = ids.engine_id
            started: set[int] = set()

            async def respond(out: RequestOutput) -> AsyncIterator[vpb.GenerateResponse]:
                if request.stream:
                    yield chunk_response(out, params, out.index not in started)
                    started.add(out.index)
                if out.is_finished:
                    yield complete_response(out, params, request.stream)

            def on_end() -> None:
                if self._live.get(ids.request_id) == ids.engine_id:
                    del self._live[ids.request_id]

            return Admitted(outputs, respond, on_end)

        responses = generate_stream(context, engine, self.observer, call_info(PROTOCOL, "text_completion", context),
                                    ids, lambda: sampling_params_from_vllm(request.sampling_params), admit)
        # aclosing: a call dropped between two messages closes the shared loop now, which closes
        # the engine stream (its KV blocks freed) and tells the observer.
        async with contextlib.aclosing(responses):
            async for response in responses:
                yield response

    @staticmethod
    def _prompt(request: vpb.GenerateRequest) -> str | list[int]:
        if request.HasField("mm_inputs") or request.extra_mm_inputs or request.HasField("media_refs"):
            raise FieldError("mm_inputs", "this model takes text only")
        if request.HasField("kv_transfer_params_json") or request.HasField("kv_transfer_params"):
            raise FieldError("kv_transfer_params", "no KV connector is configured (no prefill/decode disaggregation)")
        if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
            raise FieldError("data_parallel_rank", f"this engine has rank 0 only, got {request.data_parallel_rank}")
        kind = request.WhichOneof("input")
        if kind == "tokenized":
            if not request.tokenized.input_ids:
                raise FieldError("tokenized.input_ids", "must not be empty")
            return list(request.tokenized.input_ids)
        if kind == "text":
            if not request.text:
                raise FieldError("text", "must not be empty")
            return request.text
        raise FieldError("input", "one of tokenized or text is required")

    async def Abort(self, request: vpb.AbortRequest, context: grpc.aio.ServicerContext) -> vpb.AbortResponse:
        """Ends the named requests now (their streams finish with "abort"; KV blocks are freed at
        once); ids that are not running are ignored, as vLLM does."""
        engine = await self._async_engine(context)
        for request_id in request.request_ids:
            engine_id = self._live.get(request_id)
            if engine_id is not None:
                engine.abort(engine_id)
        return vpb.AbortResponse()

    async def Embed(self, request: vpb.EmbedRequest, context: grpc.aio.ServicerContext) -> vpb.EmbedResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Embed: this engine serves generation models only")

    async def StartProfile(self, request: common_pb2.StartProfileRequest, context: grpc.aio.ServicerContext
                           ) -> common_pb2.ProfileResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "StartProfile: no profiler is configured")

    async def StopProfile(self, request: common_pb2.StopProfileRequest, context: grpc.aio.ServicerContext
                          ) -> common_pb2.ProfileResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "StopProfile: no profiler is configured")

    # ---- probes and information -------------------------------------------------------------

    async def HealthCheck(self, request: vpb.HealthCheckRequest, context: grpc.aio.ServicerContext
                          ) -> vpb.HealthCheckResponse:
        """Healthy while it takes new requests: not while loading, draining or after an engine death."""
        try:
            self.state.ready_engine()
        except EngineUnavailableError as exc:
            return vpb.HealthCheckResponse(healthy=False, message=str(exc))
        return vpb.HealthCheckResponse(healthy=True, message="Health")

    async def GetModelInfo(self, request: vpb.GetModelInfoRequest, context: grpc.aio.ServicerContext
                           ) -> vpb.GetModelInfoResponse:
        engine = await self._async_engine(context)
        info, files = engine.model_info(), self.files
        hf = await asyncio.to_thread(files.hf_config)

        def token_id(name: str) -> int:
            value = hf.get(name)
            return value[0] if isinstance(value, list) and value else value if isinstance(value, int) else 0

        return vpb.GetModelInfoResponse(
            model_path=files.model, is_generation=True, max_context_length=info.max_model_len,
            vocab_size=info.vocab_size, supports_vision=False, served_model_name=files.served_model_name,
            tokenizer_path=str(files.tokenizer_dir), model_type=hf.get("model_type", ""),
            architectures=hf.get("architectures", []), eos_token_ids=list(info.eos_token_ids),
            pad_token_id=token_id("pad_token_id"), bos_token_id=token_id("bos_token_id"),
            max_req_input_len=info.max_model_len, default_sampling_params_json="")

    async def GetServerInfo(self, request: vpb.GetServerInfoRequest, context: grpc.aio.ServicerContext
                            ) -> vpb.GetServerInfoResponse:
        engine = await self._async_engine(context)
        info = engine.model_info()
        kv_dtype = "auto" if info.kv_cache_dtype == info.dtype else info.kv_cache_dtype.removeprefix("torch.")
        return vpb.GetServerInfoResponse(
            active_requests=engine.num_active_streams, is_paused=self.state.is_draining,
            last_receive_timestamp=self._last_receive_time, uptime_seconds=time.time() - self._start_time,
            server_type="vllm-grpc", data_parallel_size=1, kv_cache_dtype=kv_dtype, block_size=info.block_size,
            model_dtype=info.dtype, max_num_seqs=info.max_num_seqs)

    async def GetLoads(self, request: vpb.GetLoadsRequest, context: grpc.aio.ServicerContext
                       ) -> vpb.GetLoadsResponse:
        """The latest step's queue and KV use (vLLM reads its latest scheduler stats)."""
        engine = await self._async_engine(context)
        info, load = engine.model_info(), self.hub.load
        num_tokens = info.num_kv_blocks * info.block_size
        return vpb.GetLoadsResponse(timestamp=iso_timestamp(), version=_version(), dp_rank_count=1, loads=[
            vpb.SchedulerLoad(dp_rank=0, num_running_reqs=load.num_running, num_waiting_reqs=load.num_waiting,
                              num_total_reqs=load.num_running + load.num_waiting,
                              num_used_tokens=round(load.kv_cache_usage * num_tokens), max_total_num_tokens=num_tokens,
                              token_usage=load.kv_cache_usage, gen_throughput=load.gen_throughput,
                              cache_hit_rate=load.prefix_hit_rate, max_running_requests=info.max_num_seqs)])

    async def GetTokenizer(self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
                           ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        """The tokenizer files as one zip in 64 KiB chunks, its SHA-256 on the last one."""
        await self._async_engine(context)
        if self._tokenizer_zip is None:
            try:
                data = await asyncio.to_thread(build_tokenizer_zip, self.files.tokenizer_dir)
            except FileNotFoundError as exc:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            self._tokenizer_zip = data, hashlib.sha256(data).hexdigest()
        data, digest = self._tokenizer_zip
        for offset in range(0, len(data), CHUNK_BYTES):
            end = min(offset + CHUNK_BYTES, len(data))
            yield common_pb2.GetTokenizerChunk(data=data[offset:end], sha256=digest if end == len(data) else "")

    # ---- the prefix cache -------------------------------------------------------------------

    async def SubscribeKvEvents(self, request: common_pb2.SubscribeKvEventsRequest,
                                context: grpc.aio.ServicerContext) -> AsyncIterator[common_pb2.KvEventBatch]:
        await self._async_engine(context)
        await context.send_initial_metadata(())  # the subscriber's call resolves before the first batch
        async for batch in self.hub.subscribe(request.start_sequence_number, request.load_records_before_first_batch,
                                              context.cancelled):
            yield batch

    async def FlushCache(self, request: common_pb2.FlushCacheRequest, context: grpc.aio.ServicerContext
                         ) -> common_pb2.FlushCacheResponse:
        """Drop the prefix cache without preempting: with timeout_s, after waiting that long for
        running requests to end; refused (success false) while any request holds blocks."""
        engine = await self._async_engine(context)
        if request.timeout_s < 0 or request.timeout_s != request.timeout_s:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"timeout_s: must be >= 0, got {request.timeout_s}")
        if request.timeout_s > 0:
            await engine.wait_idle(request.timeout_s)
        try:
            is_flushed = await engine.reset_prefix_cache()
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        if is_flushed:
            return common_pb2.FlushCacheResponse(success=True, message="Cache flushed successfully")
        return common_pb2.FlushCacheResponse(
            success=False, message="requests hold KV blocks: the prefix cache was not flushed (retry when idle, or "
                                   "give timeout_s)")


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("minivllm")
    except metadata.PackageNotFoundError:
        return ""
