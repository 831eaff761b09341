"""A step while the scheduler builds it: the sequences it runs, and how it becomes the plain
SchedulerOutput value the runner reads (ids, diffs for the runner's rows, the cost model's view).

Kept apart from the Scheduler so the policy (who runs, how much) reads on its own; nothing here
moves a sequence's status or computed tokens (only the scheduler does)."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.block_manager import BlockManager
from engine.core.scheduler_output import NewRequestData, SchedulerOutput
from engine.core.sequence import Sequence
from engine.core.step_cost_model import StepCostModel, attention_pairs


@dataclass(slots=True)
class StepPlan:
    """A step being scheduled: its sequences (the value names them by id) and what is taken."""

    out: SchedulerOutput
    prefills: list[Sequence] = field(default_factory=list)
    verifies: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # decodes with their drafts
    decodes: list[Sequence] = field(default_factory=list)
    forks: list[Sequence] = field(default_factory=list)
    scheduled: set[int] = field(default_factory=set)  # id() of every sequence this step runs or samples

    @property
    def pays_setup(self) -> bool:
        """Whether a chunk added now pays the chunks' set-up (the cost model counts a
        verification as a chunk, so a step that verifies has paid it)."""
        return not (self.prefills or self.verifies)

    @property
    def num_tokens(self) -> int:
        """The tokens the step runs so far: each decode's one, each chunk's and verification's."""
        return (len(self.decodes) + sum(self.out.prefill_num_tokens)
                + sum(1 + len(drafts) for _, drafts in self.verifies))

    def cost_features(self) -> tuple[int, int, int, float, int]:
        """A verification is a short chunk to the cost model: its tokens, pairs and cached tokens."""
        chunks = list(zip(self.prefills, self.out.prefill_num_tokens, strict=True))
        chunks += [(s, 1 + len(d)) for s, d in self.verifies]
        pairs = sum(attention_pairs(n, s.num_computed_tokens) for s, n in chunks)
        return (len(self.decodes), sum(s.num_tokens for s in self.decodes), sum(n for _, n in chunks), pairs,
                sum(s.num_computed_tokens for s, _ in chunks))

    def to_output(self, removed_req_ids: list[str], block_manager: BlockManager,
                  cost_model: StepCostModel) -> SchedulerOutput:
        """Fill the value's ids, its diffs for the runner's rows and the cost model's view."""
        out = self.out
        out.decode_req_ids = [s.request_id for s in self.decodes]
        out.verify_req_ids = [s.request_id for s, _ in self.verifies]
        out.verify_draft_ids = [drafts for _, drafts in self.verifies]
        out.removed_req_ids = removed_req_ids
        for seq in self.prefills + [s for s, _ in self.verifies] + self.decodes + self.forks:
            if not seq.is_in_runner:
                seq.is_in_runner = True
                out.new_requests.append(NewRequestData(
                    seq.request_id, seq.prompt_token_ids, list(seq.output_token_ids),
                    [list(table) for table in seq.block_tables],
                    seq.params, seq.generator, seq.matcher, seq.min_tokens_stop_ids, seq.pooling_params,
                    seq.token_type_ids))
            elif seq.block_table_changed_from is not None:
                start = seq.block_table_changed_from
                out.block_table_updates[seq.request_id] = (start, [table[start:] for table in seq.block_tables])
            seq.block_table_changed_from = None
        out.blocks_to_copy = block_manager.take_copies()
        if not out.is_empty:
            out.cost_features = self.cost_features()
            if cost_model.num_observations:
                out.predicted_step_time = cost_model.predict(*out.cost_features)
        return out
