"""How many distinct experts a model's mixture-of-experts layers ran: the step's count for its stats.

A MoE step's cost follows the experts it reads, not its tokens (each routed expert's weights are
read once a step, whatever its rows). Each SparseMoe adds the number its experts report for
the call, which they know from the grouping they do anyway (the torch experts' per-expert row
counts, already on the host; the C++ op's routed list): counting adds no device sync and no
pass over the routes. The runner takes the sum once a step.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ExpertUsage:
    num_moe_layers: int  # the model's sparse layers
    num_touched: int = 0  # distinct experts run, summed over layers and forwards since the last take

    def add(self, num_experts: int) -> None:
        self.num_touched += num_experts

    def take(self) -> int:
        """The sum so far, and start again from 0 (one step's count)."""
        num, self.num_touched = self.num_touched, 0
        return num
