"""From sampled tokens to request outputs: timestamps, logprobs, stop checks, incremental
text that never shows a stop string, finishing, and each request's final metrics.

The scheduler has already appended the token (it owns progress); this class decides what the
token means for the client, and asks the scheduler to finish a request when it stops.
"""
from __future__ import annotations

import logging

from engine.core.scheduler import Scheduler
from engine.core.sequence import FinishReason, Sequence
from engine.outputs import RequestMetrics, RequestOutput, StepStats
from engine.processing.stop_checker import check_token_stop, find_stop_string, num_held_chars

logger = logging.getLogger(__name__)

Logprobs = dict[int, float]


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, max_model_len: int) -> None:
        self.scheduler = scheduler
        self.max_model_len = max_model_len

    def process(self, seqs: list[Sequence], logprobs: list[Logprobs | None], now: float,
                stats: StepStats) -> list[RequestOutput]:
        """One output per sequence that just got a token (its last output token). A fault while
        processing one sequence fails that request alone; the others' outputs, final ones
        included, are never lost."""
        outputs = []
        for seq, lp in zip(seqs, logprobs, strict=True):
            try:
                outputs.append(self._process_one(seq, lp, now, stats))
            except Exception as exc:  # noqa: BLE001 - contained to this request
                logger.exception("output processing failed for %s", seq.request_id)
                outputs.extend(self.fail([seq], f"engine error: {exc}", now))
        return outputs

    def abort(self, seq: Sequence, now: float) -> RequestOutput:
        self.scheduler.finish(seq, FinishReason.ABORT, now)
        return make_output(seq, [], "", None)

    def fail(self, seqs: list[Sequence], error: str, now: float) -> list[RequestOutput]:
        """End the given unfinished requests with an error (engine fault or shutdown)."""
        outputs = []
        for seq in seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, FinishReason.ERROR, now)
                outputs.append(make_output(seq, [], "", None, error=error))
        return outputs

    def _process_one(self, seq: Sequence, logprobs: Logprobs | None, now: float, stats: StepStats) -> RequestOutput:
        token_id = seq.output_token_ids[-1]
        times = seq.times
        if times.first_token is None:
            times.first_token = now
            stats.times_to_first_token.append(now - times.arrival)
        else:
            stats.inter_token_latencies.append(now - times.last_token)
        times.last_token = now
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
        reason, stop_reason = check_token_stop(seq, token_id, self.max_model_len)
        num_new_chars = len(seq.detokenizer.add_tokens([token_id]))
        params = seq.params
        if params.stop and reason is not FinishReason.STOP:
            match = find_stop_string(seq, num_new_chars)
            if match is not None:
                seq.detokenizer.truncate(match[0] + (len(match[1]) if params.include_stop_str_in_output else 0))
                reason, stop_reason = FinishReason.STOP, match[1]
        text = seq.text
        emit_end = len(text) if reason is not None or not params.stop else len(text) - num_held_chars(text, params.stop)
        new_text = text[seq.num_emitted_chars : emit_end]
        seq.num_emitted_chars = max(seq.num_emitted_chars, emit_end)
        if reason is not None:
            self.scheduler.finish(seq, reason, now)
        output = make_output(seq, [token_id], new_text, [logprobs] if logprobs is not None else None,
                             stop_reason=stop_reason)
        if seq.num_output_tokens == 1 and seq.prompt_logprobs is not None:
            output.prompt_logprobs = seq.prompt_logprobs  # with the first token, once
        return output

    @staticmethod
    def add_prompt_logprobs(seq: Sequence, first_position: int, entries: list[Logprobs]) -> None:
        """Record one chunk's prompt logprobs; a chunk recomputed after preemption adds nothing."""
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None]  # the first prompt token has no logprob
        if first_position == len(seq.prompt_logprobs):
            seq.prompt_logprobs.extend(entries)


def make_output(seq: Sequence, new_token_ids: list[int], new_text: str, new_logprobs: list[Logprobs] | None,
                stop_reason: str | int | None = None, error: str | None = None) -> RequestOutput:
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
        request_id=seq.group_id, index=seq.index, prompt_token_ids=seq.prompt_token_ids,
        token_ids=list(seq.output_token_ids), text=seq.text[: seq.num_emitted_chars],
        new_token_ids=new_token_ids, new_text=new_text,
        finish_reason=seq.finish_reason.value if finished else None, stop_reason=stop_reason,
        new_logprobs=new_logprobs, logprobs=seq.output_logprobs if seq.params.logprobs is not None else None,
        metrics=metrics, error=error)
