"""The engine: admit requests, then step. One step is four calls on values:

    sched = scheduler.schedule(now)                      # SchedulerOutput: ids and diffs
    result = runner.execute(sched)                       # RunnerOutput: sampled ids, logprobs
    updates = scheduler.update_from_output(sched, result)  # tokens applied, token stops, blocks freed
    outputs, ended = output_processor.process(updates)   # text, stop strings, logprobs, metrics

and the requests a stop string ended go back to the scheduler to finish. This class only
orchestrates: the scheduler owns request progress, the output processor what a token means for
the client, the runner the model and its own batch.

With async_scheduling the runner's calls go to one worker thread, in order, and a step returns
the outputs of the step before the one it scheduled: schedule and submit step n+1, then wait
for step n and process it while n+1 runs (vLLM v1's async scheduling). The host's scheduling,
output processing and detokenizing leave the forward's critical path; step n+1 samples only
once step n is processed (ModelRunner.execute's gate), so outputs are those of the synchronous
loop.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.config import EngineConfig, Quantization
from engine.core.block_manager import BlockManager
from engine.core.runner_output import RunnerOutput
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput
from engine.core.sequence import Sequence
from engine.errors import FieldError, QueueFullError, RequestIdInUseError
from engine.execution.heap_policy import (
    LOAD_MMAP_THRESHOLD_BYTES,
    STEP_MMAP_THRESHOLD_BYTES,
    STEP_TRIM_THRESHOLD_BYTES,
    fix_mmap_threshold,
)
from engine.execution.model_runner import ModelRunner
from engine.execution.models import model_class
from engine.execution.models.model_config import is_sequence_classifier
from engine.execution.resolved_config import resolve_config
from engine.execution.startup_phases import TOKENIZER, PhaseListener, StartupPhases
from engine.execution.weights.checkpoint import model_display_name, resolve_model
from engine.execution.weights.pooling_config import load_pooler_config
from engine.inputs import EngineRequest
from engine.outputs import FinishReason, KvCacheEvent, ModelInfo, RequestOutput, StepStats
from engine.processing.detokenizer import engine_decoder
from engine.processing.input_processor import InputProcessor, load_eos_token_ids
from engine.processing.output_processor import OutputProcessor
from engine.processing.pooling_params import PoolerConfig, PoolingParams, PoolingType
from engine.processing.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Options that only change scheduling decisions, so they can change on a loaded, idle engine.
SCHEDULING_OPTIONS = frozenset({"max_num_batched_tokens", "max_num_seqs", "max_num_waiting",
                                "enable_chunked_prefill", "min_prefill_share", "aging_s", "enable_time_budget",
                                "max_step_ms", "step_time_ratio"})


@dataclass(slots=True)
class InflightStep:
    """A step submitted to the worker (async scheduling) and not yet processed."""

    sched: SchedulerOutput
    stats: StepStats
    result: concurrent.futures.Future[RunnerOutput]
    gate: threading.Event  # set: the step may sample (ModelRunner.execute)


class LLMEngine:
    def __init__(self, config: EngineConfig, on_phase: PhaseListener | None = None) -> None:
        """Loads everything the engine serves, logging each slow phase of the start with its
        duration (engine/execution/startup_phases.py); on_phase hears each phase's name as it
        begins, on this thread (a server shows it while it loads)."""
        from transformers import AutoConfig, AutoTokenizer

        # First: reading a GGUF file's metadata and the tokenizers already makes large temporaries.
        fix_mmap_threshold(LOAD_MMAP_THRESHOLD_BYTES)
        phases = StartupPhases(on_phase)
        # Every auto settled once, before anything is loaded; below, everything reads `resolved`.
        resolved = resolve_config(config, phases)
        logger.info("%s", resolved.describe())
        self.config = config = resolved.config  # quantization settled: what the engine serves
        self.model_dir = resolve_model(config.model, native_gguf=resolved.quantization is Quantization.GGUF,
                                       phases=phases)
        # Where the tokenizer's files are (for the service's tokenizer downloads): a tokenizer
        # directory of its own, else the model's (a hub id is fetched into its cache, not here).
        is_tokenizer_dir = config.tokenizer is not None and Path(config.tokenizer).is_dir()
        self.tokenizer_dir = Path(config.tokenizer) if is_tokenizer_dir else self.model_dir
        self.model_name = model_display_name(config.model)
        with phases.phase(TOKENIZER):
            hf_config = AutoConfig.from_pretrained(str(self.model_dir))
            # Inputs are tokenized off the engine thread; the engine thread detokenizes with its own
            # decoder (a tokenizer is not thread-safe): the vocabulary and the Rust decoder where
            # that is all a decode runs, else a second whole tokenizer.
            tokenizer_path = config.tokenizer or str(self.model_dir)
            input_tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
            self._decode_ids = engine_decoder(input_tokenizer, lambda: AutoTokenizer.from_pretrained(tokenizer_path))
        # Embedding requests pool by the model's sentence-transformers recipe where it has one (else
        # the last token, normalised, as vLLM's decoder embedders); the task decides what the doors
        # serve. The engine itself runs embedding requests on any model, score requests on one with
        # a score head: a sequence classifier's, or a causal LM's label tokens (--task score).
        pooler_config = load_pooler_config(self.model_dir)
        # Without one: the family's own position (an encoder's [CLS], a decoder's last token).
        family = model_class(hf_config.model_type, getattr(hf_config, "architectures", None))
        self.pooler_config = pooler_config or PoolerConfig(getattr(family, "default_pooling_type", PoolingType.LAST))
        self.is_classifier = is_classifier = is_sequence_classifier(hf_config)
        self.task = config.task if config.task != "auto" else "score" if is_classifier else \
            "embed" if pooler_config is not None else "generate"
        self.score_label_tokens = settle_score_label_tokens(config, self.task, hf_config)
        score_token_ids = label_token_ids(input_tokenizer, self.score_label_tokens)
        logger.info("task %s (pooling: %s, normalize %s%s)", self.task, self.pooler_config.pooling_type.value,
                    self.pooler_config.normalize,
                    f"; score: logits of {', '.join(self.score_label_tokens)}" if self.score_label_tokens else "")
        self.runner = ModelRunner(self.model_dir, hf_config, resolved, phases, score_token_ids)
        fix_mmap_threshold(STEP_MMAP_THRESHOLD_BYTES, STEP_TRIM_THRESHOLD_BYTES)
        model = self.runner.model
        self.can_generate = getattr(model, "has_lm_head", True) and not is_classifier
        self.uses_token_types = bool(getattr(model, "uses_token_types", False))
        # Where a score request's state is read: a decoder's last token (its class says so), else
        # the first (a BERT cross-encoder's [CLS], which its pooler and classifier take).
        self.score_pooling_type = getattr(model, "score_pooling_type", PoolingType.CLS) \
            if is_classifier or score_token_ids else None
        if score_token_ids and not getattr(model, "has_lm_head", True):
            raise ValueError(f"{self.model_dir} has no LM head to score its label tokens with")
        if not self.can_generate and self.task == "generate":
            what = "a sequence classifier: serve it with --task score" if is_classifier else \
                "a base model's weights, as sentence-transformers saves an embedder: it can only embed; " \
                "serve it with --task embed"
            raise ValueError(f"{self.model_dir} has no LM head ({what})")
        # An encoder (bidirectional attention) runs each prompt whole in one step and keeps no K/V
        # after it: no prefix to reuse, no chunks.
        self.is_causal = self.runner.model_config.is_causal
        # Prefix-cache events are recorded only while someone subscribes (subscribe_kv_events).
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.block_size,
                                          config.enable_prefix_caching and self.is_causal, config.watermark,
                                          is_recording_events=False, windows=self.runner.kv_layout.windows)
        self._num_kv_event_subscribers = 0
        # A sequence must fit the pool even with the admission watermark held back, or it
        # could wait forever.
        usable_blocks = self.block_manager.num_blocks - self.block_manager.num_watermark_blocks
        max_positions = self.runner.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > max_positions:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's {max_positions} "
                             "positions (max_position_embeddings)")
        model_len = config.max_model_len or max_positions
        context_note = ""
        if not self.is_causal and config.max_num_batched_tokens < model_len:
            # an encoder's prompt cannot be split: it must fit one step's token budget
            model_len = config.max_num_batched_tokens
            context_note = (f" (max_num_batched_tokens: an encoder's prompt runs whole in one step; the model's "
                            f"max_position_embeddings is {max_positions})")
        # A chunk's blocks are held whole by every group (a window group's too): without chunking
        # a prompt is one chunk.
        max_chunk = config.max_num_batched_tokens if config.enable_chunked_prefill and self.is_causal else model_len
        self.max_model_len = min(model_len, self.block_manager.max_context_len(usable_blocks, max_chunk))
        self.vocab_size = self.runner.model_config.vocab_size
        self.eos_token_ids = load_eos_token_ids(self.model_dir, hf_config, input_tokenizer)
        self.input_processor = InputProcessor(input_tokenizer, self.vocab_size, self.max_model_len, config,
                                              self.eos_token_ids, context_note)
        moe = self.runner.model_config.moe  # a MoE model's step cost follows the experts it touches
        self.experts = None if moe is None else (moe.num_experts, moe.num_experts_per_tok)
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len, can_chunk_prefill=self.is_causal,
                                   experts=self.experts, is_async=config.async_scheduling)
        # Async scheduling: the thread that runs the runner's calls, in order, and its steps not
        # yet processed (at most two: the one being processed and the one running).
        self._worker = concurrent.futures.ThreadPoolExecutor(1, "minivllm-step") if config.async_scheduling else None
        self._inflight: deque[InflightStep] = deque()
        self.output_processor = OutputProcessor(self._decode_ids)
        self._pending: list[RequestOutput] = []  # outputs produced outside step() (aborts)
        self._ids = itertools.count()
        self._step_ids = itertools.count(1)
        self._injected_fault: str | None = None
        # Everything loaded so far (model, tokenizers, libraries) lives as long as the engine;
        # frozen, the collector stops walking it. Unfrozen, a full collection stalls every
        # running stream for several decode steps whenever one runs (vLLM freezes after start-up
        # too).
        gc.collect()
        gc.freeze()
        phases.finish()

    # ---- requests -------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_steps_in_flight(self) -> int:
        """Async scheduling: steps submitted and not yet processed (0 in the synchronous loop)."""
        return len(self._inflight)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_requests > 0 or bool(self._pending) or bool(self._inflight)

    def model_info(self) -> ModelInfo:
        cfg = self.config
        return ModelInfo(
            model_name=self.model_name, max_model_len=self.max_model_len, vocab_size=self.vocab_size,
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_num_waiting=cfg.max_num_waiting, block_size=cfg.block_size,
            num_kv_blocks=self.block_manager.num_blocks, device=str(self.runner.device), dtype=str(self.runner.dtype),
            eos_token_ids=tuple(sorted(self.eos_token_ids)), has_chat_template=self.input_processor.has_chat_template,
            kv_cache_dtype=str(self.runner.cache_dtype), model_dir=str(self.model_dir),
            tokenizer_dir=str(self.tokenizer_dir), task=self.task,
            hidden_size=self.runner.model_config.hidden_size, uses_token_types=self.uses_token_types,
            score_label_tokens=self.score_label_tokens)

    def reconfigure(self, **changes: Any) -> None:
        """Change scheduling options of an idle engine without reloading the model (benchmarks)."""
        unknown = set(changes) - SCHEDULING_OPTIONS
        if unknown:
            raise ValueError(f"only scheduling options can change on a loaded engine, not {sorted(unknown)}")
        if self.has_unfinished_requests():
            raise RuntimeError("reconfigure needs an idle engine")
        self.config = dataclasses.replace(self.config, **changes)  # validates
        cost_model = self.scheduler.cost_model  # what was learned about this machine still holds
        self.scheduler = Scheduler(self.config, self.block_manager, self.max_model_len,
                                   can_chunk_prefill=self.is_causal, experts=self.experts,
                                   is_async=self.config.async_scheduling)
        self.scheduler.cost_model = cost_model

    # ---- the facade the service uses (any thread unless said) ---------------------------

    @property
    def tokenizer(self) -> Any:
        """The input side's tokenizer: not thread-safe, so callers keep it to one thread (the
        service's tokenizer thread); the engine thread detokenizes with its own."""
        return self.input_processor.tokenizer

    @property
    def is_queue_full(self) -> bool:
        return self.scheduler.num_waiting >= self.config.max_num_waiting

    def check_queue(self) -> None:
        """QueueFullError when no more requests may wait (backpressure: retry later)."""
        if self.is_queue_full:
            raise QueueFullError(f"{self.scheduler.num_waiting} requests are waiting already "
                                 f"(max_num_waiting={self.config.max_num_waiting}); retry later")

    def check_in_vocabulary(self, token_ids: list[int], field: str) -> None:
        self.input_processor.check_in_vocabulary(token_ids, field)

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self.input_processor.tokenize(prompt, add_special_tokens)

    def tokenize_texts(self, texts: list[str]) -> list[list[int]]:
        return self.input_processor.tokenize_texts(texts)

    def encode_prompts(self, prompts: list[str | list[int]]) -> list[list[int] | None]:
        return self.input_processor.encode_prompts(prompts)

    def encode_pairs(self, pairs: list[tuple[str, str]]) -> list[tuple[list[int], list[int] | None]]:
        """Each pair's ids by the tokenizer's pair encoding, with its token types when the model
        reads them (else None)."""
        return self.input_processor.encode_pairs(pairs, self.uses_token_types)

    def apply_chat_template(self, messages: list[dict[str, Any]], params: SamplingParams | None = None,
                            chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        return self.input_processor.apply_chat_template(messages, params, chat_template_kwargs)

    def take_kv_events(self) -> list[KvCacheEvent]:
        """Prefix-cache changes not yet handed out (step() hands out its own in StepStats); none
        while no one subscribes."""
        return self.block_manager.take_events()

    def subscribe_kv_events(self) -> None:
        """Record prefix-cache changes from now on, for take_kv_events and each step's
        StepStats.kv_events (engine thread). A subscriber that comes later sees the changes from
        then on, as a late subscriber to vLLM's KV event publisher does; blocks cached before
        are not replayed. Each call needs its unsubscribe_kv_events."""
        self._num_kv_event_subscribers += 1
        self.block_manager.set_recording_events(True)

    def unsubscribe_kv_events(self) -> None:
        """The end of a subscribe_kv_events: once none is left, changes are no longer recorded."""
        if self._num_kv_event_subscribers == 0:
            raise RuntimeError("unsubscribe_kv_events without a subscribe_kv_events")
        self._num_kv_event_subscribers -= 1
        if self._num_kv_event_subscribers == 0:
            self.block_manager.set_recording_events(False)

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache without preempting anything (engine thread); False, and nothing
        dropped, while any request holds blocks."""
        return self.block_manager.reset_prefix_cache()

    def reset_speculative_history(self) -> None:
        """Forget what the proposers learned from earlier requests (suffix decoding's history of
        outputs), as reset_prefix_cache forgets their KV: a benchmark that repeats its prompts
        calls both between runs, or the repeat is proposed from the last run's answers."""
        if self.runner.speculator is not None:
            self.runner.speculator.proposer.reset()

    def fail_next_step(self, message: str) -> None:
        """Fault hook (tests, chaos drills): the next step's forward raises `message`, failing
        that step's requests as a real fault would; the engine goes on."""
        self._injected_fault = message

    # ---- admission: check_request, process_inputs (off the engine thread), admit ------------

    def check_request(self, params: SamplingParams | PoolingParams, request_id: str | None = None,
                      priority: int = 0) -> None:
        """The cheap checks (limits, the client's id, priority): ValueError naming the field."""
        if isinstance(params, SamplingParams) and not self.can_generate:
            raise ValueError("this model has no LM head (" + ("a sequence classifier): it cannot generate, only score"
                                                              if self.is_classifier else
                                                              "a base model's weights): it can only embed"))
        self.input_processor.check_request(params, request_id, priority)

    def process_inputs(self, params: SamplingParams | PoolingParams, prompt: str | list[int] | None = None,
                       messages: list[dict[str, Any]] | None = None, request_id: str | None = None,
                       priority: int = 0, arrival_time: float | None = None,
                       chat_template_kwargs: dict[str, Any] | None = None,
                       token_type_ids: list[int] | None = None, encoded: list[int] | None = None) -> EngineRequest:
        """Tokenize (or apply the chat template, with chat_template_kwargs such as tools=), check the
        prompt against the context and compile a grammar: the costly part of admission, on the
        caller's thread (check_request first). PoolingParams: an embedding or score request, its
        unset fields filled from the model's pooling config (FieldError for dimensions it lacks, or
        a score asked of a model without a score head). token_type_ids: each prompt token's
        segment (checked against the prompt's length), kept for a model that reads token types.
        encoded: a string prompt's ids from encode_prompts."""
        if isinstance(params, PoolingParams):
            params = params.resolved(self.pooler_config, self.runner.model_config.hidden_size,
                                     self.score_pooling_type)
            token_ids = self.input_processor.prompt_token_ids(_prefill_only(), prompt, messages, chat_template_kwargs,
                                                              is_pooling=True, encoded=encoded)
        else:
            token_ids = self.input_processor.prompt_token_ids(params, prompt, messages, chat_template_kwargs,
                                                              encoded=encoded)
        if token_type_ids is not None:
            check_token_type_ids(token_type_ids, len(token_ids))
        return EngineRequest(token_ids, params, request_id, priority, arrival_time,
                             token_type_ids if self.uses_token_types else None)

    def admit(self, request: EngineRequest) -> str:
        """Queue a processed request (engine thread); returns its id. RequestIdInUseError or
        QueueFullError when it cannot wait."""
        request_id = request.request_id or f"req-{next(self._ids)}"
        if self.scheduler.get(request_id) is not None:
            raise RequestIdInUseError("request_id", f"{request_id!r} is already in use")
        self.check_queue()
        params, token_ids = request.params, request.prompt_token_ids
        arrival = time.monotonic() if request.arrival_time is None else request.arrival_time
        if isinstance(params, PoolingParams):
            types = None if request.token_type_ids is None else np.asarray(request.token_type_ids, dtype=np.int64)
            seq = Sequence(request_id=request_id, prompt_token_ids=token_ids, params=_prefill_only(),
                           arrival_time=arrival, priority=request.priority, pooling_params=params,
                           token_type_ids=types)
            self.scheduler.add(seq)
            self.output_processor.add_request(request_id, request_id, 0, token_ids, seq.params, arrival,
                                              task=params.task.value)
            return request_id
        matcher = None
        if params.structured_output is not None:  # compiled already: a matcher is cheap
            matcher = self.input_processor.grammar.matcher(params.structured_output)
        samples = [Sequence(
            request_id=request_id if i == 0 else f"{request_id}/{i}", group_id=request_id, index=i,
            prompt_token_ids=token_ids, params=params, arrival_time=arrival, eos_token_ids=self.eos_token_ids,
            priority=request.priority, generator=self._generator(params, i),
            matcher=matcher if i == 0 or matcher is None else matcher.deep_copy()) for i in range(params.n)]
        self.scheduler.add(samples[0], forks=samples[1:])
        for seq in samples:
            self.output_processor.add_request(seq.request_id, request_id, seq.index, token_ids, params, arrival)
        return request_id

    def add_request(self, prompt: str | list[int], params: SamplingParams | PoolingParams | None = None,
                    request_id: str | None = None, priority: int = 0, arrival_time: float | None = None,
                    encoded: list[int] | None = None) -> str:
        """check_request, process_inputs and admit in one call (offline use); returns the id.
        encoded: a string prompt's ids from encode_prompts."""
        params = params or SamplingParams()
        self.check_request(params, request_id, priority)
        return self.admit(self.process_inputs(params, prompt, request_id=request_id, priority=priority,
                                              arrival_time=arrival_time, encoded=encoded))

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        """Sample i of a seeded request draws from seed + i: n reproducible, different samples."""
        if params.seed is None:
            return None
        generator = torch.Generator(device=self.runner.device)
        generator.manual_seed((params.seed + index) % 2**63)
        return generator

    def abort_request(self, request_id: str) -> bool:
        """Stop a request (every sample of it) now and free its blocks; its final outputs come
        from the next step."""
        return self._finish_samples(self.scheduler.group(request_id), FinishReason.ABORT)

    def stop_sample(self, request_id: str, index: int) -> bool:
        """End one sample of a request now, as a stop (its reader decided the answer is over: a
        repeated tool call), and free its blocks; the other samples go on. Its final output
        comes from the next step; False when that sample has already finished."""
        return self._finish_samples([s for s in self.scheduler.group(request_id) if s.index == index],
                                    FinishReason.STOP)

    def _finish_samples(self, samples: list[Sequence], reason: FinishReason) -> bool:
        """Finish these samples now with reason, freeing their blocks; their outputs go out with
        the next step. False when there were none."""
        now = time.monotonic()
        updates = [self.scheduler.finish(seq, reason, now) for seq in samples]
        self._pending += self.output_processor.process(updates, now)[0]
        return bool(samples)

    def fail_all(self, error: str) -> list[RequestOutput]:
        """End every request with an error (engine shutdown or fault); steps in flight are
        waited for and dropped."""
        now = time.monotonic()
        updates = self.scheduler.finish_requests(list(self.scheduler.requests), FinishReason.ERROR, now, error)
        while self._inflight:
            step = self._inflight.popleft()
            step.gate.set()
            if (exc := step.result.exception()) is not None:  # (its requests have failed already)
                logger.debug("a dropped step failed", exc_info=exc)
            self.scheduler.take_step(step.sched)
        return self.output_processor.process(updates, now)[0]

    # ---- the step -------------------------------------------------------------------

    def step(self) -> tuple[list[RequestOutput], StepStats]:
        if self._worker is not None:
            return self._step_async()
        t0 = time.monotonic()
        stats = StepStats(step_id=next(self._step_ids), start_time=t0)
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule(t0)
        stats.schedule_time = time.monotonic() - t0
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("step %d: %s", stats.step_id, sched.describe())
        if not sched.is_empty:
            outputs += self._run(sched, stats)
            if self.scheduler.num_requests == 0:  # fallen idle: what the steps kept, back to the OS
                self.runner.backend.release_idle_memory()
        elif sched.removed_req_ids:  # nothing to run, but rows to drop
            self.runner.batch.update(sched)
        self._record(stats, sched, outputs)
        return outputs, stats

    def _step_async(self) -> tuple[list[RequestOutput], StepStats]:
        """Schedule and submit a step, then process the one submitted before it (or, with nothing
        new to run, the last one): the outputs and stats of the step processed, or of an idle step."""
        t0 = time.monotonic()
        stats = StepStats(step_id=0, start_time=t0)
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule(t0)
        stats.schedule_time = time.monotonic() - t0
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("step scheduled: %s", sched.describe())
        if not sched.is_empty:
            gate = threading.Event()
            if not self._inflight:  # (with one in flight: once that one is processed)
                gate.set()
            fault, self._injected_fault = self._injected_fault, None
            self._inflight.append(InflightStep(sched, stats, self._worker.submit(self._execute, sched, gate, fault),
                                               gate))
        elif sched.removed_req_ids:  # rows to drop, in order with the steps
            self._worker.submit(self.runner.batch.update, sched).add_done_callback(_log_failure)
        if len(self._inflight) > 1 or (self._inflight and sched.is_empty):
            step = self._inflight.popleft()
            outputs += self._retire(step)
            stats, sched = step.stats, step.sched
        else:
            stats, sched = StepStats(step_id=0, start_time=t0), SchedulerOutput()  # (its scheduling: the step's)
        stats.step_id = next(self._step_ids)
        if not self._inflight and self.scheduler.num_requests == 0:
            self.runner.backend.release_idle_memory()
        self._record(stats, sched, outputs)
        return outputs, stats

    def _retire(self, step: InflightStep) -> list[RequestOutput]:
        """Wait for a submitted step and process it, then let the next one sample."""
        try:
            if (exc := step.result.exception()) is not None:  # one bad step must not take the engine down
                return self._fail_step(step.sched, exc)
            return self._process(step.sched, step.result.result(), step.stats)
        finally:
            if self._inflight:
                self._inflight[0].gate.set()

    def _execute(self, sched: SchedulerOutput, gate: threading.Event | None = None,
                 fault: str | None = None) -> RunnerOutput:
        """The runner's step (on the worker thread with async scheduling); fault: the injected one."""
        if fault is not None:
            # As a fault in the forward would: the step's rows are the runner's (a step scheduled
            # after it, in flight already, runs them).
            self.runner.batch.update(sched)
            raise RuntimeError(fault)
        return self.runner.execute(sched, gate)

    def _fail_step(self, sched: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        logger.error("engine step failed; failing its requests", exc_info=exc)
        now = time.monotonic()
        updates = self.scheduler.finish_step(sched, FinishReason.ERROR, now, f"engine error: {exc}")
        return self.output_processor.process(updates, now)[0]

    def _run(self, sched: SchedulerOutput, stats: StepStats) -> list[RequestOutput]:
        try:
            fault, self._injected_fault = self._injected_fault, None
            result = self._execute(sched, None, fault)
        except Exception as exc:  # noqa: BLE001 - one bad step must not take the engine down
            return self._fail_step(sched, exc)
        return self._process(sched, result, stats)

    def _process(self, sched: SchedulerOutput, result: RunnerOutput, stats: StepStats) -> list[RequestOutput]:
        """A step's result applied: tokens to their requests, outputs made, the cost model taught."""
        t1 = time.monotonic()
        for req_id, first_position, entries in result.prompt_logprobs:
            self.output_processor.add_prompt_logprobs(req_id, first_position, entries)
        if sched.verify_req_ids:
            num_first = len(sched.prefill_sample_rows)
            stats.accepted_lengths = [len(tokens) - 1 for tokens in
                                      result.sampled_token_ids[num_first : num_first + len(sched.verify_req_ids)]]
            stats.num_draft_tokens = sum(map(len, sched.verify_draft_ids))
            stats.num_accepted_tokens = sum(stats.accepted_lengths)
        updates = self.scheduler.update_from_output(sched, result, t1)
        outputs, ended = self.output_processor.process(updates, t1, stats)
        for req_id, reason in ended.items():  # a stop string, or a fault formatting that request
            self.scheduler.finish_requests([req_id], reason, t1)
        stats.prepare_time, stats.forward_time, stats.sample_time = (result.prepare_time, result.forward_time,
                                                                     result.sample_time)
        stats.num_experts_touched, stats.num_moe_layers = result.num_experts_touched, self.runner.num_moe_layers
        stats.process_time = time.monotonic() - t1
        # With async scheduling the scheduling and this processing run beside the next forward.
        overhead = stats.prepare_time + stats.sample_time if self._worker is not None else stats.overhead_time
        self.scheduler.observe_step_time(sched, stats.forward_time, overhead)
        return outputs

    def _record(self, stats: StepStats, sched: SchedulerOutput, outputs: list[RequestOutput]) -> None:
        stats.num_waiting, stats.num_running = self.scheduler.num_waiting, self.scheduler.num_running
        stats.kv_cache_usage = self.block_manager.usage
        stats.num_preemptions = len(sched.preempted_req_ids)
        stats.num_prefix_queried_tokens = sched.num_prefix_queried_tokens
        stats.num_prefix_hit_tokens = sched.num_prefix_hit_tokens
        stats.budget_source = sched.budget_source
        stats.step_time_target, stats.predicted_step_time = sched.step_time_target, sched.predicted_step_time
        stats.num_prefill_tokens, stats.num_decode_tokens = sched.num_prefill_tokens, sched.num_decode_tokens
        stats.num_prefill_seqs, stats.num_decode_seqs = len(sched.prefill_req_ids), len(sched.decode_req_ids)
        stats.num_verify_tokens, stats.spec_method = sched.num_verify_tokens, self.config.speculative_method
        stats.prefill_request_ids, stats.decode_request_ids = list(sched.prefill_req_ids), list(sched.decode_req_ids)
        stats.num_generated_tokens = sum(len(o.new_token_ids) for o in outputs)
        stats.finished = [o.metrics for o in outputs if o.metrics is not None]
        stats.kv_events = self.take_kv_events()


def _log_failure(future: concurrent.futures.Future[Any]) -> None:
    if (exc := future.exception()) is not None:
        logger.error("the step worker failed to drop rows", exc_info=exc)


def settle_score_label_tokens(config: EngineConfig, task: str, hf_config: Any) -> tuple[str, ...]:
    """The label tokens a causal LM served for scores is scored by (config.score_label_tokens, or
    Qwen3-Reranker's no, yes); none for a sequence classifier, which has its own head, or for
    another task. ValueError for label tokens where none apply, or a classifier of more than one
    label (a score is one logit's sigmoid)."""
    is_classifier = is_sequence_classifier(hf_config)
    if config.score_label_tokens is not None and (task != "score" or is_classifier):
        raise ValueError("score_label_tokens scores a causal LM by its LM head (--task score); this model is "
                         + ("a sequence classifier, scored by its own head" if is_classifier else f"served for {task}"))
    if task != "score":
        return ()
    if is_classifier:
        num_labels = getattr(hf_config, "num_labels", 1)
        if num_labels != 1:
            raise ValueError(f"the model classifies into {num_labels} labels; --task score serves one-label "
                             "cross-encoders and rerankers")
        return ()
    return config.label_tokens or ("no", "yes")


def label_token_ids(tokenizer: Any, tokens: tuple[str, ...]) -> tuple[int, ...]:
    """The vocabulary ids of a score's label tokens (one: its logit; two: the second's logit minus
    the first's), as tokens, not texts (Qwen3-Reranker's card: convert_tokens_to_ids("yes"))."""
    ids = []
    for token in tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or (token_id == tokenizer.unk_token_id and token != tokenizer.unk_token):
            raise ValueError(f"score_label_tokens: {token!r} is not a token of the model's vocabulary")
        ids.append(int(token_id))
    return tuple(ids)


def check_token_type_ids(token_type_ids: list[int], num_tokens: int) -> None:
    """A prompt's token types: one non-negative integer per prompt token (FieldError naming them)."""
    if len(token_type_ids) != num_tokens:
        raise FieldError("token_type_ids", f"{len(token_type_ids)} values for a prompt of {num_tokens} tokens")
    for i, value in enumerate(token_type_ids):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise FieldError(f"token_type_ids[{i}]", f"{value!r} is not a non-negative integer")


def _prefill_only() -> SamplingParams:
    """The sampling side of a pooling request (the scheduler's and the output side's common
    view of a request): it never samples, so only its prompt checks read it (no max_tokens: a
    prompt may fill the whole context)."""
    return SamplingParams(max_tokens=None)
