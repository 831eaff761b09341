"""From the scheduler's per-request updates to request outputs: timestamps, logprobs,
incremental text that never shows a stop string, stop strings themselves, and each request's
final metrics.

It keeps what a token means for the client (a RequestState per sample: detokenizer, emitted
text, logprobs), apart from the scheduler's state, and never calls the scheduler: requests that
a stop string ends (or that fail here) are returned to the engine, which finishes them there
(vLLM's split: token-level stops in the scheduler, stop strings in output processing).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.outputs import FinishReason, RequestMetrics, RequestOutput, StepStats
from engine.processing.detokenizer import IncrementalDetokenizer
from engine.processing.sampling_params import SamplingParams
from engine.processing.sequence_update import SequenceUpdate
from engine.processing.stop_checker import find_stop_string, num_held_chars

logger = logging.getLogger(__name__)

Logprobs = dict[int, float]


@dataclass(slots=True, eq=False)
class RequestState:
    """One sample's output side."""

    request_id: str
    group_id: str  # the request's id, which outputs carry
    index: int  # the sample
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    detokenizer: IncrementalDetokenizer
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[Logprobs] = field(default_factory=list)
    prompt_logprobs: list[Logprobs | None] | None = None  # per prompt position, when asked
    num_emitted_chars: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    task: str = "generate"  # embed | score: a pooling request (its one output carries the vector or the scores)

    @property
    def text(self) -> str:
        return self.detokenizer.text


class OutputProcessor:
    def __init__(self, decode_ids: Callable[..., str]) -> None:
        """decode_ids: the engine thread's tokenizer's decode (detokenizer.engine_decoder)."""
        self._decode_ids = decode_ids
        self.states: dict[str, RequestState] = {}

    def add_request(self, request_id: str, group_id: str, index: int, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float, task: str = "generate") -> None:
        self.states[request_id] = RequestState(
            request_id, group_id, index, prompt_token_ids, params, arrival_time,
            IncrementalDetokenizer(self._decode_ids, prompt_token_ids, params.skip_special_tokens), task=task)

    def add_prompt_logprobs(self, request_id: str, first_position: int, entries: list[Logprobs]) -> None:
        """Record one chunk's prompt logprobs; a chunk recomputed after preemption adds nothing."""
        state = self.states.get(request_id)
        if state is None:
            return
        if state.prompt_logprobs is None:
            state.prompt_logprobs = [None]  # the first prompt token has no logprob
        if first_position == len(state.prompt_logprobs):
            state.prompt_logprobs.extend(entries)

    def process(self, updates: list[SequenceUpdate], now: float, stats: StepStats | None = None
                ) -> tuple[list[RequestOutput], dict[str, FinishReason]]:
        """One output per update. Also returns the requests this ended that the scheduler still
        runs (a stop string: STOP; a fault while formatting one: ERROR, that request alone;
        the others' outputs, final ones included, are never lost)."""
        outputs: list[RequestOutput] = []
        ended: dict[str, FinishReason] = {}
        for update in updates:
            try:
                output, reason = self._process_one(update, now, stats)
            except Exception as exc:  # noqa: BLE001 - contained to this request
                logger.exception("output processing failed for %s", update.request_id)
                if update.finish_reason is None:
                    ended[update.request_id] = FinishReason.ERROR
                outputs.append(self._error_output(update, f"engine error: {exc}", now))
                continue
            if reason is not None and update.finish_reason is None:
                ended[update.request_id] = reason
            outputs.append(output)
        return outputs, ended

    def _process_one(self, update: SequenceUpdate, now: float, stats: StepStats | None
                     ) -> tuple[RequestOutput, FinishReason | None]:
        state = self.states[update.request_id]
        reason, stop_reason = update.finish_reason, update.stop_reason
        params = state.params
        new_text = ""
        new_token_ids, new_logprobs = list(update.new_token_ids), update.new_logprobs
        for i, token_id in enumerate(new_token_ids):
            # One token at a time: a verification brings several, and a stop string that the
            # first completes must end the output there (vLLM drops the run's tokens after it).
            state.output_token_ids.append(token_id)
            num_new_chars = len(state.detokenizer.add_tokens([token_id]))
            is_scheduler_stop = reason is FinishReason.STOP and i == len(new_token_ids) - 1
            if params.stop and not is_scheduler_stop and len(state.output_token_ids) >= params.min_tokens:
                match = find_stop_string(state.text, num_new_chars, params)
                if match is not None:
                    state.detokenizer.truncate(match[0] + (len(match[1]) if params.include_stop_str_in_output else 0))
                    reason, stop_reason = FinishReason.STOP, match[1]
                    new_token_ids = new_token_ids[: i + 1]
                    new_logprobs = None if new_logprobs is None else new_logprobs[: i + 1]
                    break
        if new_token_ids:
            if state.first_token_time is None:
                state.first_token_time = now
                if stats is not None:
                    stats.times_to_first_token.append(now - state.arrival_time)
            elif stats is not None:
                stats.inter_token_latencies.append(now - state.last_token_time)
            state.last_token_time = now
            if new_logprobs is not None:
                state.output_logprobs.extend(new_logprobs)
            text = state.text
            emit_end = len(text) if reason is not None or not params.stop \
                else len(text) - num_held_chars(text, params.stop)
            new_text = text[state.num_emitted_chars : emit_end]
            state.num_emitted_chars = max(state.num_emitted_chars, emit_end)
        output = self._output(state, update, new_token_ids, new_text, reason, stop_reason, now, new_logprobs=new_logprobs)
        if len(state.output_token_ids) == len(new_token_ids) and new_token_ids and state.prompt_logprobs is not None:
            output.prompt_logprobs = state.prompt_logprobs  # with the first token, once
        return output, reason

    def _error_output(self, update: SequenceUpdate, error: str, now: float) -> RequestOutput:
        state = self.states.get(update.request_id)
        if state is None:  # no state to format from: the bare error still ends the stream
            return RequestOutput(update.request_id, [], [], "", [], "", FinishReason.ERROR.value, error=error)
        return self._output(state, update, [], "", FinishReason.ERROR, None, now, error)

    def _output(self, state: RequestState, update: SequenceUpdate, new_token_ids: list[int], new_text: str,
                reason: FinishReason | None, stop_reason: int | str | None, now: float,
                error: str | None = None, new_logprobs: list | None = None) -> RequestOutput:
        error = error or update.error
        metrics = None
        if reason is not None:
            del self.states[state.request_id]
            metrics = RequestMetrics(
                request_id=state.request_id, finish_reason=reason.value,
                num_prompt_tokens=len(state.prompt_token_ids), num_output_tokens=len(state.output_token_ids),
                num_cached_tokens=update.num_cached_tokens, num_preemptions=update.num_preemptions,
                arrival_time=state.arrival_time, first_scheduled_time=update.first_scheduled_time,
                first_token_time=state.first_token_time,
                finished_time=update.finished_time if update.finished_time is not None else now,
                num_draft_tokens=update.num_draft_tokens, num_accepted_tokens=update.num_accepted_tokens,
                task=state.task)
        logprobs = new_logprobs if new_token_ids else None
        return RequestOutput(
            request_id=state.group_id, index=state.index, prompt_token_ids=state.prompt_token_ids,
            token_ids=list(state.output_token_ids), text=state.text[: state.num_emitted_chars],
            new_token_ids=new_token_ids, new_text=new_text,
            finish_reason=reason.value if reason is not None else None, stop_reason=stop_reason,
            new_logprobs=logprobs, logprobs=state.output_logprobs if state.params.logprobs is not None else None,
            metrics=metrics, error=error, embedding=update.pooled if state.task == "embed" else None,
            scores=update.pooled if state.task == "score" else None)
