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

The engine's step is `schedule()` -> the runner's forward and sampling -> `update_from_output()`;
only this class moves a sequence's status and num_computed_tokens (vLLM's split). The runner
never sees a Sequence: `schedule()` returns a value that names requests by id and carries the
diffs the runner's own rows need (engine/core/scheduler_output.py), and `update_from_output`
takes the runner's value back, appends the tokens, checks the token-level stops and frees what
finished. Output formatting gets plain SequenceUpdate values and never calls back here.

Async scheduling (is_async) schedules step n+1 before step n's tokens are back. schedule() then
counts its own step as done at once (computed tokens advanced, a PLACEHOLDER output for each
token it will sample), so the next schedule sees every request where the synchronous loop would;
update_from_output puts the tokens in their places. A request a step ended (EOS, a stop string,
an abort) may have been scheduled once more: that row's token is dropped. What is known ahead
(max_tokens, the context) is never scheduled past.
"""
from __future__ import annotations

import sys

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.runner_output import RunnerOutput
from engine.core.scheduler_output import SchedulerOutput
from engine.core.sequence import Sequence, SequenceStatus
from engine.core.step_cost_model import StepCostModel
from engine.core.step_plan import StepPlan
from engine.core.time_budget import TimeBudget
from engine.errors import RequestIdInUseError
from engine.outputs import FinishReason
from engine.processing.sequence_update import SequenceUpdate
from engine.processing.structured_output import GrammarExecutor


class Scheduler:
    BURST_QUEUE_SLACK = TimeBudget.BURST_QUEUE_SLACK

    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int = sys.maxsize,
                 can_chunk_prefill: bool = True, experts: tuple[int, int] | None = None, is_async: bool = False) -> None:
        """can_chunk_prefill: False for a model whose attention is bidirectional (an encoder): each
        prompt is then prefilled whole in one step, never split by the token or time budget.
        experts: a mixture-of-experts model's (experts, experts a token), for the step cost model.
        is_async: steps are scheduled one ahead of their outputs (the module's docstring)."""
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.can_chunk_prefill = can_chunk_prefill
        self.is_async = is_async
        self.requests: dict[str, Sequence] = {}  # every unfinished request, by id
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []  # in admission order: oldest first
        self.pending_forks: dict[str, list[Sequence]] = {}  # by group: samples waiting for sample 0's prompt
        self.cost_model = StepCostModel(experts=experts)
        self.time_budget = TimeBudget(config, self.cost_model, block_manager.block_size)
        self._step = 0
        self._removed_req_ids: list[str] = []  # rows the runner must drop at the next step
        self._grammar = GrammarExecutor()
        # Async scheduling: each step in flight's sequences (by id() of its SchedulerOutput), with the
        # tokens it computes for each and that sequence's preemption count when it was scheduled.
        self._in_flight: dict[int, dict[str, tuple[Sequence, int, int]]] = {}

    @property
    def min_chunk(self) -> int:
        """A time-budgeted step's least prefill (TimeBudget.fit says why)."""
        return self.time_budget.min_chunk

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

    def add(self, seq: Sequence, forks: list[Sequence] | None = None) -> None:
        """Queue a request; `forks` are its other samples (n > 1), which fork from it once the
        chunk that ends its prompt is scheduled."""
        for s in [seq, *(forks or [])]:
            if s.request_id in self.requests:
                raise RequestIdInUseError("request_id", f"{s.request_id!r} is already in use")
        seq.status = SequenceStatus.WAITING
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)
        if forks:
            for child in forks:
                child.status = SequenceStatus.FORK_PENDING
                self.requests[child.request_id] = child
            self.pending_forks[seq.group_id] = list(forks)

    def finish(self, seq: Sequence, reason: FinishReason, now: float, error: str | None = None,
               stop_reason: int | str | None = None) -> SequenceUpdate:
        """End a request (stopped, aborted or failed): out of the queues, blocks freed, its row
        dropped from the runner at the next step. Returns the update that says so."""
        self._end(seq, reason, now)
        return self._update(seq, [], None, reason, stop_reason, error)

    def _end(self, seq: Sequence, reason: FinishReason, now: float) -> None:
        """seq is finished: out of its queue (running, waiting, or a fork pending), its blocks
        freed, its runner row dropped at the next step."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq in self.pending_forks.get(seq.group_id, ()):
            self.pending_forks[seq.group_id].remove(seq)
            if not self.pending_forks[seq.group_id]:
                del self.pending_forks[seq.group_id]
        seq.status, seq.finish_reason, seq.times.finished = SequenceStatus.FINISHED, reason, now
        seq.drop_placeholders()
        self.block_manager.free(seq)
        self._drop_row(seq)
        self.requests.pop(seq.request_id, None)

    def finish_requests(self, request_ids: list[str], reason: FinishReason, now: float,
                        error: str | None = None) -> list[SequenceUpdate]:
        """finish() each of these that is still unfinished."""
        seqs = [self.requests[r] for r in request_ids if r in self.requests]
        return [self.finish(seq, reason, now, error) for seq in seqs]

    def group(self, group_id: str) -> list[Sequence]:
        """The unfinished samples of a request (one unless it asked for n > 1)."""
        return [s for s in self.requests.values() if s.group_id == group_id]

    def _drop_row(self, seq: Sequence) -> None:
        if seq.is_in_runner:
            seq.is_in_runner = False
            self._removed_req_ids.append(seq.request_id)

    def _fork(self, parent: Sequence, out: SchedulerOutput, scheduled: set[int]) -> list[Sequence]:
        """The other samples of parent's request join it as its prompt's last chunk is scheduled:
        they share its blocks (copy-on-write later) and sample from its logits row this step."""
        children = self.pending_forks.pop(parent.group_id, [])
        for child in children:
            self.block_manager.fork(parent, child)
            child.num_computed_tokens = parent.num_prompt_tokens
            child.num_cached_prompt_tokens = parent.num_cached_prompt_tokens
            child.times.first_scheduled = parent.times.first_scheduled
            child.status = SequenceStatus.RUNNING
            child.last_scheduled_step = self._step
            self.running.append(child)
            out.fork_req_ids.append(child.request_id)
            out.fork_parent_ids.append(parent.request_id)
            scheduled.add(id(child))
        return children

    def effective_priority(self, seq: Sequence, now: float) -> float:
        return seq.priority - (now - seq.arrival_time) / self.config.aging_s

    def schedule(self, now: float) -> SchedulerOutput:
        cfg = self.config
        plan = StepPlan(SchedulerOutput())
        self._step += 1
        # (A pooling prompt whose last chunk is in flight has nothing left: async scheduling.)
        prefilling = [s for s in self.running if not s.is_decode and s.num_uncomputed_tokens]
        has_prefill_work = bool(self.waiting or prefilling)
        reserve = int(cfg.max_num_batched_tokens * cfg.min_prefill_share) if has_prefill_work else 0
        decode_budget = cfg.max_num_batched_tokens - reserve

        # Decodes first. Those skipped last time (budget-limited) go first this time. Proposals
        # ride on what the plain decodes leave (_add_verifications).
        decodes = sorted((s for s in self.running if s.is_decode), key=lambda s: s.last_scheduled_step)
        num_decode_tokens = 0
        for seq in decodes:
            if num_decode_tokens >= decode_budget or len(plan.scheduled) >= cfg.max_num_seqs:
                break
            if seq.status is not SequenceStatus.RUNNING or (self.is_async and seq.will_reach_a_limit(self.max_model_len)):
                continue  # preempted earlier in this loop, or its step in flight ends it
            if self._make_room(seq, 1, plan):
                plan.decodes.append(seq)
                plan.scheduled.add(id(seq))
                seq.last_scheduled_step = self._step
                num_decode_tokens += 1
        if cfg.speculative_method != "none":
            num_decode_tokens += self._add_verifications(plan, decode_budget - num_decode_tokens)

        # Prefill: chunks already under way, then the waiting queue by aged priority.
        budget = cfg.max_num_batched_tokens - num_decode_tokens
        has_decodes = bool(plan.decodes or plan.verifies)
        time_left = self.time_budget.allowance(plan.out, plan.cost_features() if has_decodes else None,
                                               self._num_generating(self.waiting), self._num_generating(self.running))
        for seq in [s for s in prefilling if s.status is SequenceStatus.RUNNING]:
            if budget <= 0 or len(plan.scheduled) >= cfg.max_num_seqs:
                break
            num_new = self.time_budget.fit(plan.out, seq.num_computed_tokens, self._chunk(seq, budget, bool(plan.prefills)),
                                           time_left, not plan.prefills, plan.pays_setup, self.can_chunk_prefill,
                                           plan.num_tokens)
            if num_new == 0 or not self._make_room(seq, num_new, plan):
                break
            time_left -= self.cost_model.chunk_cost(num_new, seq.num_computed_tokens, plan.pays_setup, plan.num_tokens)
            budget -= self._add_prefill(plan, seq, num_new)

        self.waiting.sort(key=lambda s: (self.effective_priority(s, now), s.arrival_time))
        while self.waiting and budget > 0 and len(plan.scheduled) < cfg.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_placeholders:
                break  # preempted while its step ran: back once that step's token is in place
            seq.num_computed_tokens = self.block_manager.allocate_cached_prefix(seq)
            if seq.num_preemptions == 0:
                seq.num_cached_prompt_tokens = seq.num_computed_tokens
            num_new = self.time_budget.fit(plan.out, seq.num_computed_tokens, self._chunk(seq, budget, bool(plan.prefills)),
                                           time_left, not plan.prefills, plan.pays_setup, self.can_chunk_prefill,
                                           plan.num_tokens)
            if num_new == 0 or not self.block_manager.allocate(seq, num_new, is_new=True):
                # Head of line stays at the head: skipping it would starve long prompts.
                self.block_manager.free(seq)
                seq.num_computed_tokens = 0
                break
            self.waiting.pop(0)
            plan.out.num_prefix_queried_tokens += seq.num_tokens if self.block_manager.enable_prefix_caching else 0
            plan.out.num_prefix_hit_tokens += seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            if seq.times.first_scheduled is None:
                seq.times.first_scheduled = now
            self.running.append(seq)
            time_left -= self.cost_model.chunk_cost(num_new, seq.num_computed_tokens, plan.pays_setup, plan.num_tokens)
            budget -= self._add_prefill(plan, seq, num_new)
        out = plan.to_output(self._removed_req_ids, self.block_manager, self.cost_model)
        self._removed_req_ids = []
        if self.is_async:
            self._count_as_done(out)
        return out

    def _count_as_done(self, out: SchedulerOutput) -> None:
        """Async scheduling: the step's tokens as computed and a placeholder for each token it
        samples, before it runs, so the next step is scheduled as if it had (no verifications:
        their accepted lengths are known only after the step)."""
        requests = self.requests
        computed = dict(zip(out.prefill_req_ids, out.prefill_num_tokens, strict=True))
        computed.update((req_id, 1) for req_id in out.decode_req_ids)
        for req_id, num_new in computed.items():
            seq = requests[req_id]
            seq.num_computed_tokens += num_new
            seq.num_inflight_tokens += num_new
        for req_id in out.sampling_req_ids:
            requests[req_id].add_placeholder()
        self._in_flight[id(out)] = {req_id: (requests[req_id], computed.get(req_id, 0),
                                             requests[req_id].num_preemptions) for req_id in out.scheduled_req_ids}

    def take_step(self, sched: SchedulerOutput) -> dict[str, Sequence]:
        """The sequences sched ran that are still unfinished, looked up by id; async scheduling
        forgets the step (its tokens are no longer in flight). A request that ended while its step
        ran is missing, and so is one whose id a new request has taken since (an abort, then the
        id again): the step's tokens are not the newcomer's. The synchronous loop processes a step
        before anything else can end a request: every request is the step's or not in it."""
        if not self.is_async:
            return self.requests
        live = {}
        for req_id, (seq, num_computed, num_preemptions) in self._in_flight.pop(id(sched), {}).items():
            if self.requests.get(req_id) is not seq:
                continue
            if seq.num_preemptions == num_preemptions:  # (a preemption has counted them out already)
                seq.num_inflight_tokens -= num_computed
            live[req_id] = seq
        return live

    def finish_step(self, sched: SchedulerOutput, reason: FinishReason, now: float,
                    error: str | None = None) -> list[SequenceUpdate]:
        """End every unfinished request a step ran (the step failed)."""
        live = self.take_step(sched)
        return [self.finish(live[r], reason, now, error) for r in sched.scheduled_req_ids if r in live]

    @staticmethod
    def _num_generating(seqs: list[Sequence]) -> int:
        """The generation requests among seqs (pooling requests never join the decode batch)."""
        return sum(not seq.is_pooling for seq in seqs)

    def _add_verifications(self, plan: StepPlan, budget: int) -> int:
        """Turn scheduled decodes that have proposals into verifications, with what the plain
        decodes left: budget tokens and free blocks (the admissions' watermark kept), never a
        preemption, so a request's speculation cannot cost another request its place. Off past
        speculative_max_batch decodes, where the step's rows already fill the weights' read.
        Returns the draft tokens added."""
        if len(plan.decodes) > self.config.speculative_max_batch:
            return 0  # (the runner proposes nothing there either)
        num_drafts = 0
        plain = []
        for seq in plan.decodes:
            drafts = self._drafts(seq, budget - num_drafts)
            if drafts and self.block_manager.allocate(seq, 1 + len(drafts), is_new=True):
                plan.verifies.append((seq, drafts))
                num_drafts += len(drafts)
            else:
                plain.append(seq)
        plan.decodes = plain
        return num_drafts

    def _drafts(self, seq: Sequence, budget: int) -> list[int]:
        """The proposals seq verifies this step: within the budget, the context (the last one
        verified sits at position max_model_len - 2, so the token after it still fits) and
        max_tokens (nothing past the last token the request may emit), and, for a grammar, only
        the prefix the grammar accepts (the runner stops proposing for a request whose recent
        acceptance is low)."""
        limit = min(budget, self.max_model_len - seq.num_tokens - 1)
        if seq.params.max_tokens is not None:
            limit = min(limit, seq.params.max_tokens - seq.num_output_tokens - 1)
        drafts = seq.spec_token_ids[: max(0, limit)]
        if not drafts:
            return []
        if seq.matcher is not None:
            drafts = drafts[: seq.matcher.validate_tokens(drafts)]
        return drafts

    def observe_step_time(self, sched: SchedulerOutput, forward_time: float, overhead_time: float) -> None:
        """Teach the cost model what the step scheduled by `sched` took."""
        self.cost_model.observe(*sched.cost_features, forward_time, overhead_time)

    def update_from_output(self, sched: SchedulerOutput, out: RunnerOutput, now: float) -> list[SequenceUpdate]:
        """Fold a finished forward back, the one place that does: the scheduled tokens are now
        in the KV cache (full blocks go to the prefix cache), each sampled token is appended, a
        grammar advances over it, and the stops it decides (EOS, stop ids, max_tokens, the
        context, a complete grammar) finish the request and free its blocks; tokens past a stop
        are dropped. A verifying decode keeps the KV of its accepted drafts only: its computed
        count stops there, and blocks taken for rejected drafts alone go back to the pool.
        Returns one update per sampled request, for output processing."""
        requests = self.take_step(sched)
        if not self.is_async:  # (async: counted when scheduled)
            for req_id, num_new in zip(sched.prefill_req_ids, sched.prefill_num_tokens, strict=True):
                requests[req_id].num_computed_tokens += num_new
            for req_id in sched.decode_req_ids + sched.verify_req_ids:
                requests[req_id].num_computed_tokens += 1
        num_drafts = dict(zip(sched.verify_req_ids, map(len, sched.verify_draft_ids), strict=True))
        # None: a request that ended while its step ran (async scheduling); its tokens are dropped.
        seqs = [requests.get(r) for r in out.req_ids]
        for seq, tokens in zip(seqs, out.sampled_token_ids, strict=True):
            if seq is not None and seq.request_id in num_drafts:  # the accepted drafts' KV is valid; the rejected ones' is not
                self._count_acceptance(seq, num_drafts[seq.request_id], len(tokens) - 1)
                seq.num_computed_tokens += len(tokens) - 1
        for req_id in sched.prefill_req_ids + sched.decode_req_ids:
            if (seq := requests.get(req_id)) is not None:
                self.block_manager.register_computed_blocks(seq)
        single = [(seq.matcher, tokens[0]) for seq, tokens in zip(seqs, out.sampled_token_ids, strict=True)
                  if seq is not None and seq.matcher is not None and len(tokens) == 1]
        if single:
            self._grammar.consume(single)
        updates = [self._finish_pooled(requests[req_id], pooled, now)
                   for req_id, pooled in zip(out.pooled_req_ids, out.pooled, strict=True) if req_id in requests]
        for seq, tokens, logprobs in zip(seqs, out.sampled_token_ids, out.logprobs, strict=True):
            if seq is None:
                continue
            reason = stop_reason = None
            for i, token_id in enumerate(tokens):
                if seq.matcher is not None and len(tokens) > 1:
                    seq.matcher.consume_token(token_id)
                if seq.num_placeholders:
                    seq.fill_placeholder(token_id)
                else:
                    seq.output_token_ids.append(token_id)
                reason, stop_reason = seq.check_stop(token_id, self.max_model_len)
                if reason is not None:
                    tokens, logprobs = tokens[: i + 1], None if logprobs is None else logprobs[: i + 1]
                    break
            if seq.request_id in num_drafts:  # its accepted drafts' tokens are in place only now
                # A stop inside the accepted run drops the KV past it with its tokens.
                seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
                self.block_manager.register_computed_blocks(seq)
            if reason is not None:
                self._end(seq, reason, now)
            else:
                if seq.request_id in num_drafts:
                    self.block_manager.trim(seq)
                seq.spec_token_ids = out.draft_token_ids.get(seq.request_id, [])
            updates.append(self._update(seq, tokens, logprobs, reason, stop_reason))
        return updates

    def _finish_pooled(self, seq: Sequence, pooled: list[float], now: float) -> SequenceUpdate:
        """A pooling request's prompt is done and pooled: it ends here, its blocks freed at once
        (the full ones stay revivable in the prefix cache, as any finished request's)."""
        update = self.finish(seq, FinishReason.STOP, now)
        update.pooled = pooled
        return update

    @staticmethod
    def _count_acceptance(seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        seq.num_draft_tokens += num_drafts
        seq.num_accepted_tokens += num_accepted

    @staticmethod
    def _update(seq: Sequence, new_token_ids: list[int], new_logprobs: list | None, reason: FinishReason | None,
                stop_reason: int | str | None, error: str | None = None) -> SequenceUpdate:
        return SequenceUpdate(seq.request_id, new_token_ids, new_logprobs, reason, stop_reason, error,
                              seq.times.first_scheduled, seq.num_cached_prompt_tokens, seq.num_preemptions,
                              seq.times.finished, seq.num_draft_tokens, seq.num_accepted_tokens)

    def _chunk(self, seq: Sequence, budget: int, has_prefill: bool) -> int:
        remaining = seq.num_uncomputed_tokens
        if remaining <= budget:
            return remaining
        if self.config.enable_chunked_prefill and self.can_chunk_prefill:
            return budget
        # Without chunking a prompt over the budget runs whole, alone with the decodes:
        # the stall the chunked mode exists to avoid (kept for the benchmark's comparison). An
        # encoder's prompts never exceed the budget (the engine's context is at most it): one
        # that does not fit what is left waits for the next step.
        return 0 if has_prefill else remaining

    def _add_prefill(self, plan: StepPlan, seq: Sequence, num_new: int) -> int:
        out = plan.out
        is_last = num_new == seq.num_uncomputed_tokens
        out.prefill_req_ids.append(seq.request_id)
        out.prefill_num_tokens.append(num_new)
        out.prefill_num_computed.append(seq.num_computed_tokens)
        out.prefill_is_last_chunk.append(is_last)
        out.prefill_is_pooling.append(seq.is_pooling)
        plan.prefills.append(seq)
        plan.scheduled.add(id(seq))
        seq.last_scheduled_step = self._step
        if is_last and seq.needs_fork:
            plan.forks += self._fork(seq, out, plan.scheduled)
        return num_new

    def _make_room(self, seq: Sequence, num_new: int, plan: StepPlan) -> bool:
        """Allocate blocks for seq, preempting the newest unscheduled running sequences."""
        while not self.block_manager.allocate(seq, num_new):
            victim = self._pick_victim(seq, plan.scheduled)
            # The samples of one request go together: none is left behind half the group.
            for member in [victim] + [s for s in self.running if s.group_id == victim.group_id and s is not victim
                                      and s is not seq and id(s) not in plan.scheduled]:
                self._preempt(member, plan.out)
            if victim is seq:
                return False
        return True

    def _pick_victim(self, seq: Sequence, scheduled: set[int]) -> Sequence:
        # The newest running sequence loses the least work; it may be seq itself. Not one that its
        # step in flight ends (async scheduling): its pooled prompt or its last token is under way.
        candidates = [s for s in self.running if id(s) not in scheduled and s.num_uncomputed_tokens
                      and not s.will_reach_a_limit(self.max_model_len)]
        return max(candidates, key=lambda s: s.arrival_time) if candidates else seq

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Preemption by recompute: drop the cache, keep the tokens; prefill runs them again."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        self._drop_row(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = seq.num_inflight_tokens = 0
        seq.num_preemptions += 1
        self.waiting.insert(0, seq)
        out.preempted_req_ids.append(seq.request_id)
