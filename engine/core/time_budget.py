"""How much of a step the prefill chunks may take while streams decode in it: the step-time
target the scheduler holds a step with decodes to, and the chunk that fits what is left of it."""
from __future__ import annotations

from engine.config import EngineConfig
from engine.core.scheduler_output import SchedulerOutput
from engine.core.step_cost_model import StepCostModel


class TimeBudget:
    # The first few waiting requests are not a burst: a long prompt or two arriving behind one or
    # two streams would double their steps. Past these, each one per running stream counts.
    BURST_QUEUE_SLACK = 3

    def __init__(self, config: EngineConfig, cost_model: StepCostModel, block_size: int) -> None:
        self.config = config
        self.cost_model = cost_model
        self.block_size = block_size

    @property
    def min_chunk(self) -> int:
        """A time-budgeted step's least prefill: half a block (fit says why)."""
        return max(1, self.block_size // 2)

    def allowance(self, out: SchedulerOutput, decode_features: tuple[int, int, int, float, int] | None,
                  num_waiting: int, num_running: int) -> float:
        """Seconds of this step the prefill chunks may take: unbounded unless sequences decode
        (then the streams wait for the whole step, so it is held to the step-time target).
        decode_features: the cost model's features of the step's decodes and verifications (a
        verification is a short chunk to it), None when nothing decodes. num_waiting,
        num_running: the generation requests waiting and running (a burst's measure; pooling
        requests are not counted, see below). Sets the value's budget_source and
        step_time_target when it holds the step."""
        cfg = self.config
        if not (cfg.enable_time_budget and cfg.enable_chunked_prefill and decode_features is not None):
            return float("inf")
        model = self.cost_model
        # This step's decodes in the fit's own terms (the first chunk's cost adds the set-up),
        # and the streams' pace that the target is a multiple of (StepCostModel.decode_pace).
        decode_time = model.predict(*decode_features)
        pace = model.decode_pace(decode_time)
        # Auto: a multiple of the streams' own pace (this batch decoding alone), so a step with
        # prefill is at most step_time_ratio slower than the gaps these clients get without it.
        # The pace is predicted for this batch, not averaged over past decode-only steps: under
        # a steady stream of arrivals there are none, and the last ones (a smaller batch) held
        # the chunks to a pace the batch had outgrown (a closed loop then kept its decode batch
        # small and lost throughput).
        # A burst (requests waiting past the first BURST_QUEUE_SLACK) is worth slower steps: the
        # queue's TTFT grows with every step it waits, and the bigger batch it becomes decodes
        # more tokens per second. The first few get no relief: a couple queued behind one or two
        # streams doubled the target, and those steps were the streams' worst gaps. Not a
        # floor on the batch instead (counting a batch as at least 8 streams): while a served
        # burst ramps up (3-4 streams, 28 behind them) that held the target to about half.
        # Pooling requests (embeddings, scores) are no part of a burst: they never join the batch,
        # so they buy it no throughput, and twelve embeddings queued beside 8 streams had slowed
        # every stream's steps past the promised step_time_ratio (by 1 + (12 - 3) / 8).
        backlog = 1.0 + max(0, num_waiting - self.BURST_QUEUE_SLACK) / max(1, num_running)
        target = cfg.max_step_ms / 1e3 if cfg.max_step_ms is not None else cfg.step_time_ratio * pace * backlog
        out.budget_source, out.step_time_target = "time", target
        # Aim below the target by the model's usual error, so most steps really land under it;
        # waiting requests keep a share of the step even when decodes alone fill the target.
        aim = target / max(1.0, model.error_quantile)
        return max(aim - decode_time, cfg.min_prefill_share * target)

    def fit(self, out: SchedulerOutput, num_computed_tokens: int, num_new: int, time_left: float,
            is_first: bool, pays_setup: bool, can_split: bool = True, num_step_tokens: int = 0) -> int:
        """The most of num_new tokens whose chunk fits time_left (is_first: the step's first
        prefill chunk; pays_setup: nothing in the step has paid the chunks' set-up yet, which a
        verification already has: the cost model counts it as a chunk). can_split False (an
        encoder's prompt): all of num_new or none, except that the step's first runs whole
        whatever it costs, or it would never run. num_step_tokens: the step's tokens so far, whose
        experts a MoE model's chunk shares."""
        if out.budget_source != "time" or num_new == 0:
            return num_new
        fit = self.cost_model.max_chunk(time_left, num_computed_tokens, num_new, pays_setup, num_step_tokens)
        if not can_split:
            return num_new if fit >= num_new or is_first else 0
        if is_first:
            # Progress guarantee: the first chunk of a step is at least half a block, so a long
            # prompt finishes its prefill in bounded time however slow the model thinks it is.
            # Not a whole block: over a long context a block of prefill costs more than a small
            # batch's decode step, and those steps were the streams' worst gaps.
            fit = max(fit, min(num_new, self.min_chunk))
        return fit
