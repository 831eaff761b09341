"""The engine: add requests, then step. One step = schedule -> prefill -> decode -> sample ->
process outputs, returning per-request deltas and a StepStats value."""
from __future__ import annotations

import itertools
import logging
import time
from typing import Any

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import PromptTooLongError, QueueFullError
from engine.model_loader import model_display_name, resolve_model
from engine.model_runner import ModelRunner, RunnerConfig
from engine.outputs import RequestMetrics, RequestOutput, StepStats
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.scheduler_output import SchedulerOutput
from engine.sequence import FinishReason, Sequence, SequenceStatus
from engine.stop_checker import check_token_stop, find_stop_string, num_held_chars

logger = logging.getLogger(__name__)

_VALID_ROLES = ("system", "user", "assistant", "tool")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        self.config = config
        self.model_dir = resolve_model(config.model)
        self.model_name = model_display_name(config.model)
        hf_config = AutoConfig.from_pretrained(str(self.model_dir))
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or str(self.model_dir))
        self.runner = ModelRunner(self.model_dir, hf_config, RunnerConfig(
            device=config.device, dtype=config.dtype, block_size=config.block_size,
            num_kv_blocks=config.num_kv_blocks, kv_cache_gib=config.kv_cache_gib, num_threads=config.num_threads))
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.block_size,
                                          config.enable_prefix_caching, config.watermark)
        # A sequence must fit the pool even with the admission watermark held back, or it
        # could wait forever.
        usable_blocks = self.block_manager.num_blocks - self.block_manager.num_watermark_blocks
        model_len = config.max_model_len or self.runner.model_config.max_position_embeddings
        self.max_model_len = min(model_len, usable_blocks * config.block_size)
        self.vocab_size = self.runner.model_config.vocab_size
        self.eos_token_ids = self._eos_ids(GenerationConfig, hf_config)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
            enable_chunked_prefill=config.enable_chunked_prefill, min_prefill_share=config.min_prefill_share,
            aging_s=config.aging_s), self.block_manager)
        self.sampler = Sampler(self.runner.device, config.seed)
        self._seqs: dict[str, Sequence] = {}
        self._pending: list[RequestOutput] = []  # outputs produced outside step() (aborts)
        self._ids = itertools.count()
        self._step_ids = itertools.count(1)

    def _eos_ids(self, generation_config_cls: Any, hf_config: Any) -> frozenset[int]:
        ids: set[int] = set()
        try:
            eos = generation_config_cls.from_pretrained(str(self.model_dir)).eos_token_id
        except OSError:
            eos = getattr(hf_config, "eos_token_id", None)
        for value in eos if isinstance(eos, list) else [eos]:
            if value is not None:
                ids.add(int(value))
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(ids)

    # ---- requests -------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    def has_unfinished_requests(self) -> bool:
        return bool(self._seqs) or bool(self._pending)

    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if not messages:
            raise ValueError("messages: must not be empty")
        for i, m in enumerate(messages):
            if m.get("role") not in _VALID_ROLES:
                raise ValueError(f"messages[{i}].role: {m.get('role')!r} is not one of {_VALID_ROLES}")
            if not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}].content: must be a string")
        if self.tokenizer.chat_template is None:
            raise ValueError("messages: this model has no chat template; send a prompt instead")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, arrival_time: float | None = None) -> str:
        """Queue a request; returns its id. Raises ValueError (or a subclass) on bad input."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            token_ids = self.tokenize(prompt)
        else:
            token_ids = [int(t) for t in prompt]
            if not token_ids:
                raise ValueError("prompt_token_ids: must not be empty")
            bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"prompt_token_ids: {bad} is outside the vocabulary [0, {self.vocab_size})")
        if any(not 0 <= t < self.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids: must be in [0, {self.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(f"prompt: {len(token_ids)} tokens do not fit the context of "
                                     f"{self.max_model_len} tokens (at least one must be generated)")
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        elif not request_id:
            raise ValueError("request_id: must not be empty")
        if request_id in self._seqs:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if self.scheduler.num_waiting >= self.config.max_num_waiting:
            raise QueueFullError(f"{self.scheduler.num_waiting} requests are waiting already "
                                 f"(max_num_waiting={self.config.max_num_waiting}); retry later")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.runner.device)
            generator.manual_seed(params.seed)
        seq = Sequence(
            request_id=request_id, prompt_token_ids=token_ids, params=params,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            detokenizer=IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens),
            eos_token_ids=self.eos_token_ids, priority=priority, generator=generator)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; its final output comes from the next step."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        self._finish(seq, FinishReason.ABORT, time.monotonic())
        self._pending.append(self._make_output(seq, [], "", None))
        return True

    def fail_all(self, error: str) -> list[RequestOutput]:
        """End every request with an error (engine shutdown or fault)."""
        now = time.monotonic()
        outputs = []
        for seq in list(self._seqs.values()):
            self._finish(seq, FinishReason.ERROR, now)
            outputs.append(self._make_output(seq, [], "", None, error=error))
        return outputs

    # ---- the step -------------------------------------------------------------------

    def step(self) -> tuple[list[RequestOutput], StepStats]:
        t0 = time.monotonic()
        stats = StepStats(step_id=next(self._step_ids), start_time=t0)
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule(t0)
        t1 = time.monotonic()
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("step %d: %s", stats.step_id, sched.describe())
        stats.schedule_time = t1 - t0
        if not sched.is_empty:
            try:
                outputs.extend(self._run(sched, stats))
            except Exception as exc:  # noqa: BLE001 - one bad step must not take the engine down
                logger.exception("engine step %d failed; failing its requests", stats.step_id)
                outputs.extend(self._fail_step(sched, f"engine error: {exc}"))
        stats.num_waiting = self.scheduler.num_waiting
        stats.num_running = self.scheduler.num_running
        stats.kv_cache_usage = self.block_manager.usage
        stats.num_preemptions = len(sched.preempted_seqs)
        stats.num_prefix_queried_tokens = sched.num_prefix_queried_tokens
        stats.num_prefix_hit_tokens = sched.num_prefix_hit_tokens
        stats.finished = [o.metrics for o in outputs if o.metrics is not None]
        return outputs, stats

    def _run(self, sched: SchedulerOutput, stats: StepStats) -> list[RequestOutput]:
        t0 = time.monotonic()
        logits = []
        sampling_seqs: list[Sequence] = []
        prefill_prepare = decode_prepare = 0.0
        if sched.prefill_seqs:
            prefill_logits = self.runner.run_prefill(sched.prefill_seqs, sched.prefill_num_tokens)
            prefill_prepare = self.runner.last_timings.prepare
            rows = [i for i, (s, n) in enumerate(zip(sched.prefill_seqs, sched.prefill_num_tokens, strict=True))
                    if s.num_computed_tokens + n == s.num_tokens]
            if rows:
                logits.append(prefill_logits if len(rows) == len(sched.prefill_seqs) else prefill_logits[rows])
                sampling_seqs.extend(sched.prefill_seqs[i] for i in rows)
        t1 = time.monotonic()
        if sched.decode_seqs:
            logits.append(self.runner.run_decode(sched.decode_seqs))
            decode_prepare = self.runner.last_timings.prepare
            sampling_seqs.extend(sched.decode_seqs)
        t2 = time.monotonic()
        sampled = self.sampler(torch.cat(logits) if len(logits) > 1 else logits[0], sampling_seqs) if logits else None
        t3 = time.monotonic()
        for seq, n in zip(sched.prefill_seqs, sched.prefill_num_tokens, strict=True):
            seq.num_computed_tokens += n
        for seq in sched.decode_seqs:
            seq.num_computed_tokens += 1
        for seq in sched.prefill_seqs + sched.decode_seqs:
            self.block_manager.register_computed_blocks(seq)
        outputs = []
        if sampled is not None:
            for seq, token_id, logprobs in zip(sampling_seqs, sampled.token_ids, sampled.logprobs, strict=True):
                outputs.append(self._append_token(seq, token_id, logprobs, t3, stats))
        t4 = time.monotonic()
        # Forward times exclude host-side input preparation, which counts as overhead.
        stats.prepare_time = prefill_prepare + decode_prepare
        stats.prefill_time = t1 - t0 - prefill_prepare
        stats.decode_time = t2 - t1 - decode_prepare
        stats.sample_time, stats.process_time = t3 - t2, t4 - t3
        stats.num_prefill_tokens, stats.num_decode_tokens = sched.num_prefill_tokens, sched.num_decode_tokens
        stats.num_prefill_seqs, stats.num_decode_seqs = len(sched.prefill_seqs), len(sched.decode_seqs)
        stats.prefill_request_ids = [s.request_id for s in sched.prefill_seqs]
        stats.decode_request_ids = [s.request_id for s in sched.decode_seqs]
        stats.num_generated_tokens = len(outputs)
        return outputs

    def _append_token(self, seq: Sequence, token_id: int, logprobs: dict[int, float] | None, now: float,
                      stats: StepStats) -> RequestOutput:
        times = seq.times
        if times.first_token is None:
            times.first_token = now
            stats.times_to_first_token.append(now - times.arrival)
        else:
            stats.inter_token_latencies.append(now - times.last_token)
        times.last_token = now
        seq.output_token_ids.append(token_id)
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
        reason, stop_reason = check_token_stop(seq, token_id, self.max_model_len)
        num_new_chars = len(seq.detokenizer.add_tokens([token_id]))
        params = seq.params
        if params.stop and reason is not FinishReason.STOP:
            match = find_stop_string(seq, num_new_chars)
            if match is not None:
                seq.detokenizer.truncate(match[0])
                reason, stop_reason = FinishReason.STOP, match[1]
        text = seq.text
        emit_end = len(text) if reason is not None or not params.stop else len(text) - num_held_chars(text, params.stop)
        new_text = text[seq.num_emitted_chars : emit_end]
        seq.num_emitted_chars = max(seq.num_emitted_chars, emit_end)
        if reason is not None:
            self._finish(seq, reason, now)
        return self._make_output(seq, [token_id], new_text, [logprobs] if logprobs is not None else None,
                                 stop_reason=stop_reason)

    def _finish(self, seq: Sequence, reason: FinishReason, now: float) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.times.finished = now
        self.scheduler.remove(seq)
        self._seqs.pop(seq.request_id, None)

    def _fail_step(self, sched: SchedulerOutput, error: str) -> list[RequestOutput]:
        now = time.monotonic()
        outputs = []
        for seq in sched.prefill_seqs + sched.decode_seqs:
            if not seq.is_finished:
                self._finish(seq, FinishReason.ERROR, now)
                outputs.append(self._make_output(seq, [], "", None, error=error))
        return outputs

    def _make_output(self, seq: Sequence, new_token_ids: list[int], new_text: str,
                     new_logprobs: list[dict[int, float]] | None, stop_reason: str | int | None = None,
                     error: str | None = None) -> RequestOutput:
        finished = seq.is_finished
        metrics = None
        if finished:
            t = seq.times
            metrics = RequestMetrics(
                request_id=seq.request_id, finish_reason=seq.finish_reason.value,
                num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
                num_cached_tokens=seq.num_cached_prompt_tokens, num_preemptions=seq.num_preemptions,
                arrival_time=t.arrival, first_scheduled_time=t.first_scheduled, first_token_time=t.first_token,
                finished_time=t.finished)
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids), text=seq.text[: seq.num_emitted_chars],
            new_token_ids=new_token_ids, new_text=new_text,
            finish_reason=seq.finish_reason.value if finished else None, stop_reason=stop_reason,
            new_logprobs=new_logprobs, logprobs=seq.output_logprobs if seq.params.logprobs is not None else None,
            metrics=metrics, error=error)
