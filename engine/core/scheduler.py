"""Token-budget scheduler: decides, each step, which prefill chunks and decodes run, and owns
every request's progress (status, computed tokens, appended tokens, finishing).

The seed's two failure modes and what prevents each:
- A long prefill stalls every running stream: decodes are scheduled first, and a prompt
  longer than what is left of the budget is prefilled in chunks across steps.
- A crowd of decodes starves new requests: while requests wait, min_prefill_share of the
  budget is kept for prefill, and waiting requests are ordered by priority lowered with
  age (aging), so no request waits forever behind newer, more urgent ones.
When KV blocks run out a decode preempts the newest running sequence (recompute): its
blocks are freed and it goes back to the waiting queue with its tokens intact. The queue is
sorted by aged priority, so it is not literally at the front: it runs before every request of
its priority that arrived after it (its age counts from its original arrival).

The engine's step is `schedule()` -> forward and sampling -> `update_from_output()`; only this
class moves a sequence's status and num_computed_tokens (vLLM's split, nano-vllm's
`postprocess`), so the runner and the output processor read sequences and never advance them.
"""
from __future__ import annotations

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.scheduler_output import SchedulerOutput
from engine.core.sequence import FinishReason, Sequence, SequenceStatus
from engine.core.step_cost_model import StepCostModel, attention_pairs
from engine.errors import RequestIdInUseError


class Scheduler:
    # The first few waiting requests are not a burst: a long prompt or two arriving behind one or
    # two streams would double their steps. Past these, each one per running stream counts.
    BURST_QUEUE_SLACK = 3

    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.requests: dict[str, Sequence] = {}  # every unfinished request, by id
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []  # in admission order: oldest first
        self.cost_model = StepCostModel()
        self._step = 0

    @property
    def min_chunk(self) -> int:
        """A time-budgeted step's least prefill: half a block (_fit_time says why)."""
        return max(1, self.block_manager.block_size // 2)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def get(self, request_id: str) -> Sequence | None:
        return self.requests.get(request_id)

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise RequestIdInUseError(f"request_id: {seq.request_id!r} is already in use")
        seq.status = SequenceStatus.WAITING
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: FinishReason, now: float) -> None:
        """End a request (stopped, aborted or failed): out of the queues, blocks freed."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.times.finished = now
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        self.requests.pop(seq.request_id, None)

    def group(self, group_id: str) -> list[Sequence]:
        """The unfinished samples of a request (one unless it asked for n > 1)."""
        return [s for s in self.requests.values() if s.group_id == group_id]

    def fork(self, parent: Sequence, children: list[Sequence], row: int, sched: SchedulerOutput
             ) -> list[tuple[int, int]]:
        """Adopt the other samples of parent's request, now that its prompt is computed: they
        share its blocks and sample from its logits row this step. Returns the (source, copy)
        blocks whose K/V must be copied (the partly filled last block, copy-on-write). A sample
        that finds no free block for its copy waits instead and recomputes its prompt (its full
        blocks then come from the prefix cache): nothing is lost, nothing blocks."""
        copies = []
        for child in children:
            if child.request_id in self.requests:
                raise RequestIdInUseError(f"request_id: {child.request_id!r} is already in use")
            self.requests[child.request_id] = child
            child.times.first_scheduled = parent.times.first_scheduled
            try:
                pair = self.block_manager.fork(parent, child)
            except MemoryError:
                child.status = SequenceStatus.WAITING
                self.waiting.insert(0, child)
                continue
            if pair is not None:
                copies.append(pair)
            child.status = SequenceStatus.RUNNING
            child.num_computed_tokens = parent.num_prompt_tokens
            self.running.append(child)
            sched.forked_seqs.append(child)
            sched.fork_rows.append(row)
        return copies

    def effective_priority(self, seq: Sequence, now: float) -> float:
        return seq.priority - (now - seq.arrival_time) / self.config.aging_s

    def schedule(self, now: float) -> SchedulerOutput:
        cfg = self.config
        out = SchedulerOutput()
        self._step += 1
        scheduled: set[int] = set()
        prefilling = [s for s in self.running if not s.is_decode]
        has_prefill_work = bool(self.waiting or prefilling)
        reserve = int(cfg.max_num_batched_tokens * cfg.min_prefill_share) if has_prefill_work else 0
        decode_budget = cfg.max_num_batched_tokens - reserve

        # Decodes first. Those skipped last time (budget-limited) go first this time.
        decodes = sorted((s for s in self.running if s.is_decode), key=lambda s: s.last_scheduled_step)
        for seq in decodes:
            if len(out.decode_seqs) >= decode_budget or len(scheduled) >= cfg.max_num_seqs:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if self._make_room(seq, 1, scheduled, out):
                out.decode_seqs.append(seq)
                scheduled.add(id(seq))
                seq.last_scheduled_step = self._step

        # Prefill: chunks already under way, then the waiting queue by aged priority.
        budget = cfg.max_num_batched_tokens - len(out.decode_seqs)
        time_left = self._prefill_time_allowance(out)
        for seq in [s for s in prefilling if s.status is SequenceStatus.RUNNING]:
            if budget <= 0 or len(scheduled) >= cfg.max_num_seqs:
                break
            num_new = self._fit_time(seq, self._chunk(seq, budget, bool(out.prefill_seqs)), time_left, out)
            if num_new == 0 or not self._make_room(seq, num_new, scheduled, out):
                break
            time_left -= self.cost_model.chunk_cost(num_new, seq.num_computed_tokens, not out.prefill_seqs)
            budget -= self._add_prefill(out, seq, num_new, scheduled)

        self.waiting.sort(key=lambda s: (self.effective_priority(s, now), s.arrival_time))
        while self.waiting and budget > 0 and len(scheduled) < cfg.max_num_seqs:
            seq = self.waiting[0]
            seq.num_computed_tokens = self.block_manager.allocate_cached_prefix(seq)
            if seq.num_preemptions == 0:
                seq.num_cached_prompt_tokens = seq.num_computed_tokens
            num_new = self._fit_time(seq, self._chunk(seq, budget, bool(out.prefill_seqs)), time_left, out)
            if num_new == 0 or not self.block_manager.allocate(seq, num_new, is_new=True):
                # Head of line stays at the head: skipping it would starve long prompts.
                self.block_manager.free(seq)
                seq.num_computed_tokens = 0
                break
            self.waiting.pop(0)
            out.num_prefix_queried_tokens += seq.num_tokens if self.block_manager.enable_prefix_caching else 0
            out.num_prefix_hit_tokens += seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            if seq.times.first_scheduled is None:
                seq.times.first_scheduled = now
            self.running.append(seq)
            time_left -= self.cost_model.chunk_cost(num_new, seq.num_computed_tokens, not out.prefill_seqs)
            budget -= self._add_prefill(out, seq, num_new, scheduled)
        if not out.is_empty:
            out.cost_features = self._step_features(out)
            if self.cost_model.num_observations:
                out.predicted_step_time = self.cost_model.predict(*out.cost_features)
        return out

    def _prefill_time_allowance(self, out: SchedulerOutput) -> float:
        """Seconds of this step the prefill chunks may take: unbounded unless sequences decode
        (then the streams wait for the whole step, so it is held to the step-time target)."""
        cfg = self.config
        if not (cfg.enable_time_budget and cfg.enable_chunked_prefill and out.decode_seqs):
            return float("inf")
        model = self.cost_model
        # This step's decodes in the fit's own terms (the first chunk's cost adds the set-up),
        # and the streams' pace that the target is a multiple of (StepCostModel.decode_pace).
        decode_time = model.predict(len(out.decode_seqs), sum(s.num_tokens for s in out.decode_seqs))
        pace = model.decode_pace(decode_time)
        # Auto: a multiple of the streams' own pace (this batch decoding alone), so a step with
        # prefill is at most step_time_ratio slower than the gaps these clients get without it.
        # The pace is predicted for this batch, not averaged over past decode-only steps: under
        # a steady stream of arrivals there are none, and the last ones (a smaller batch) held
        # the chunks to a pace the batch had outgrown (closed loop of 32 streams: a mean decode
        # batch of 14 and 26 % less throughput than without the time budget).
        # A burst (requests waiting past the first BURST_QUEUE_SLACK) is worth slower steps: the
        # queue's TTFT grows with every step it waits, and the bigger batch it becomes decodes
        # more tokens per second. The first few get no relief: a couple queued behind one or two
        # streams doubled the target and put the top 1 % of gaps past 3x the median step. Not a
        # floor on the batch instead (counting a batch as at least 8 streams): while a served
        # burst ramps up (3-4 streams, 28 behind them) that held the target to about half
        # (served throughput measured 0.2-3 % lower, within this machine's noise).
        backlog = 1.0 + max(0, len(self.waiting) - self.BURST_QUEUE_SLACK) / max(1, len(self.running))
        target = cfg.max_step_ms / 1e3 if cfg.max_step_ms is not None else cfg.step_time_ratio * pace * backlog
        out.budget_source, out.step_time_target = "time", target
        # Aim below the target by the model's usual error, so most steps really land under it;
        # waiting requests keep a share of the step even when decodes alone fill the target.
        aim = target / max(1.0, model.error_quantile)
        return max(aim - decode_time, cfg.min_prefill_share * target)

    def _fit_time(self, seq: Sequence, num_new: int, time_left: float, out: SchedulerOutput) -> int:
        if out.budget_source != "time" or num_new == 0:
            return num_new
        fit = self.cost_model.max_chunk(time_left, seq.num_computed_tokens, num_new, not out.prefill_seqs)
        if not out.prefill_seqs:
            # Progress guarantee: the first chunk of a step is at least half a block, so a long
            # prompt finishes its prefill in bounded time however slow the model thinks it is.
            # Not a whole block: over a long context a block of prefill costs about two fp32
            # decode steps of a small batch, and those steps were the top 1 % of gaps.
            fit = max(fit, min(num_new, self.min_chunk))
        return fit

    @staticmethod
    def _step_features(sched: SchedulerOutput) -> tuple[int, int, int, float, int]:
        pairs = sum(attention_pairs(n, s.num_computed_tokens)
                    for s, n in zip(sched.prefill_seqs, sched.prefill_num_tokens, strict=True))
        return (len(sched.decode_seqs), sum(s.num_tokens for s in sched.decode_seqs), sched.num_prefill_tokens, pairs,
                sum(s.num_computed_tokens for s in sched.prefill_seqs))

    def observe_step_time(self, sched: SchedulerOutput, forward_time: float, overhead_time: float) -> None:
        """Teach the cost model what the step scheduled by `sched` took."""
        self.cost_model.observe(*sched.cost_features, forward_time, overhead_time)

    def update_from_output(self, sched: SchedulerOutput, sampled_token_ids: list[int]) -> None:
        """Fold a finished forward back into the sequences: the scheduled tokens are now in the
        KV cache (full blocks go to the prefix cache), and each sampling sequence
        (`sched.sampling_seqs`, in order) gets its new token."""
        for seq, num_new in zip(sched.prefill_seqs, sched.prefill_num_tokens, strict=True):
            seq.num_computed_tokens += num_new
        for seq in sched.decode_seqs:
            seq.num_computed_tokens += 1
        for seq in sched.prefill_seqs + sched.decode_seqs:
            self.block_manager.register_computed_blocks(seq)
        for seq, token_id in zip(sched.sampling_seqs, sampled_token_ids, strict=True):
            seq.output_token_ids.append(token_id)

    def _chunk(self, seq: Sequence, budget: int, has_prefill: bool) -> int:
        remaining = seq.num_uncomputed_tokens
        if remaining <= budget:
            return remaining
        if self.config.enable_chunked_prefill:
            return budget
        # Without chunking a prompt over the budget runs whole, alone with the decodes:
        # the stall the chunked mode exists to avoid (kept for the benchmark's comparison).
        return 0 if has_prefill else remaining

    def _add_prefill(self, out: SchedulerOutput, seq: Sequence, num_new: int, scheduled: set[int]) -> int:
        out.prefill_seqs.append(seq)
        out.prefill_num_tokens.append(num_new)
        out.prefill_is_last_chunk.append(num_new == seq.num_uncomputed_tokens)
        scheduled.add(id(seq))
        seq.last_scheduled_step = self._step
        return num_new

    def _make_room(self, seq: Sequence, num_new: int, scheduled: set[int], out: SchedulerOutput) -> bool:
        """Allocate blocks for seq, preempting the newest unscheduled running sequences."""
        while not self.block_manager.allocate(seq, num_new):
            victim = self._pick_victim(seq, scheduled)
            # The samples of one request go together: none is left behind half the group.
            for member in [victim] + [s for s in self.running if s.group_id == victim.group_id and s is not victim
                                      and s is not seq and id(s) not in scheduled]:
                self._preempt(member, out)
            if victim is seq:
                return False
        return True

    def _pick_victim(self, seq: Sequence, scheduled: set[int]) -> Sequence:
        # The newest running sequence loses the least work; it may be seq itself.
        candidates = [s for s in self.running if id(s) not in scheduled]
        return max(candidates, key=lambda s: s.arrival_time) if candidates else seq

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Preemption by recompute: drop the cache, keep the tokens; prefill runs them again."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.waiting.insert(0, seq)
        out.preempted_seqs.append(seq)
