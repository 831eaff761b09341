"""Token-budget scheduler: decides, each step, which prefill chunks and decodes run.

The seed's two failure modes and what prevents each:
- A long prefill stalls every running stream: decodes are scheduled first, and a prompt
  longer than what is left of the budget is prefilled in chunks across steps.
- A crowd of decodes starves new requests: while requests wait, min_prefill_share of the
  budget is kept for prefill, and waiting requests are ordered by priority lowered with
  age (aging), so no request waits forever behind newer, more urgent ones.
When KV blocks run out a decode preempts the newest running sequence (recompute): its
blocks are freed and it rejoins the front of the queue with its tokens intact.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.scheduler_output import SchedulerOutput
from engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True
    min_prefill_share: float = 0.25
    aging_s: float = 5.0


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []  # in admission order: oldest first
        self._step = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

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
        for seq in [s for s in prefilling if s.status is SequenceStatus.RUNNING]:
            if budget <= 0 or len(scheduled) >= cfg.max_num_seqs:
                break
            num_new = self._chunk(seq, budget, bool(out.prefill_seqs))
            if num_new == 0 or not self._make_room(seq, num_new, scheduled, out):
                break
            budget -= self._add_prefill(out, seq, num_new, scheduled)

        self.waiting.sort(key=lambda s: (self.effective_priority(s, now), s.arrival_time))
        while self.waiting and budget > 0 and len(scheduled) < cfg.max_num_seqs:
            seq = self.waiting[0]
            seq.num_computed_tokens = self.block_manager.allocate_cached_prefix(seq)
            if seq.num_preemptions == 0:
                seq.num_cached_prompt_tokens = seq.num_computed_tokens
            num_new = self._chunk(seq, budget, bool(out.prefill_seqs))
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
            budget -= self._add_prefill(out, seq, num_new, scheduled)
        return out

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
        scheduled.add(id(seq))
        seq.last_scheduled_step = self._step
        return num_new

    def _make_room(self, seq: Sequence, num_new: int, scheduled: set[int], out: SchedulerOutput) -> bool:
        """Allocate blocks for seq, preempting the newest unscheduled running sequences."""
        while not self.block_manager.allocate(seq, num_new):
            victim = self._pick_victim(seq, scheduled)
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _pick_victim(self, seq: Sequence, scheduled: set[int]) -> Sequence:
        # The newest running sequence loses the least work; it may be seq itself.
        candidates = [s for s in self.running if id(s) not in scheduled]
        return max(candidates, key=lambda s: s.arrival_time) if candidates else seq

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.waiting.insert(0, seq)
        out.preempted_seqs.append(seq)

