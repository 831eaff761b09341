"""The CPU backend's MoE experts: a SparseMoe's stacked experts swapped for the C++ MoeExperts op
(engine/execution/kernels/moe_experts.cpp), which reads only the routed experts' panels, each once
a call, and runs every routed expert's rows as one small GEMM.

Each expert's gate_up ([2I, H]: gate rows, then up rows) and down ([H, I]) are panels of their
own: from a float Experts module, PackedWeight panels of the backend's dtype (float32, bfloat16,
or int8 with per-channel scales); from a GGUF file, the QuantizedWeight lists the loader attaches
to the module as `quantized_gate_up` / `quantized_down` (its float parameters then left on the
meta device), kept in the file's blocks.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from types import ModuleType

import torch
from torch import nn

from engine.execution.backends.cpu_gguf import kernel_args
from engine.execution.models.moe import Experts, MoeConfig, SparseMoe
from engine.execution.weights.packed_weight import PackedWeight, place_on_huge_pages
from engine.execution.weights.quantized_weight import QuantizedWeight

# moe.py's activation names as the kernel's Activation codes (cpu_kernels.h).
ACTIVATION_CODES = {"silu": 0, "swiglu_oai": 2}

Panels = PackedWeight | QuantizedWeight


def _is_real(t: torch.Tensor | None) -> bool:
    return t is not None and t.device.type != "meta"


def _with_bias(weight: QuantizedWeight, bias: torch.Tensor | None) -> QuantizedWeight:
    """The file's blocks with the module's float bias row where the blocks carry none (the data is shared)."""
    if weight.bias is not None or bias is None:
        return weight
    return dataclasses.replace(weight, bias=bias.detach().float().contiguous().clone())


class PackedExperts(nn.Module):
    """Experts' forward on the C++ op: x [T, H], expert_ids [T, k] int64, weights [T, k] -> [T, H] in x's dtype."""

    def __init__(self, cfg: MoeConfig, hidden_size: int, gate_up: Sequence[Panels], down: Sequence[Panels],
                 kernels: ModuleType, isa: int) -> None:
        super().__init__()
        if len(gate_up) != cfg.num_experts or len(down) != cfg.num_experts:
            raise ValueError(f"experts: {len(gate_up)} gate_up and {len(down)} down panels for {cfg.num_experts} experts")
        self.cfg, self.hidden_size = cfg, hidden_size
        self.gate_up_panels, self.down_panels = list(gate_up), list(down)
        self.num_touched = 0  # distinct experts the last forward ran (the op's own count)
        self.op = kernels.MoeExperts([kernel_args(w) for w in self.gate_up_panels],
                                     [kernel_args(w) for w in self.down_panels], hidden_size, cfg.intermediate_size,
                                     ACTIVATION_CODES[cfg.activation], cfg.swiglu_alpha, cfg.swiglu_limit, isa)

    @staticmethod
    def panels_of(experts: Experts, dtype: torch.dtype) -> tuple[list[Panels], list[Panels]]:
        """Each expert's gate_up and down panels: the GGUF blocks the loader attached, else the
        float parameters packed in `dtype` (float32, bfloat16 or int8)."""
        quantized_gate_up = getattr(experts, "quantized_gate_up", None)
        quantized_down = getattr(experts, "quantized_down", None)
        num_experts = experts.cfg.num_experts

        def bias_row(bias: torch.Tensor | None, e: int) -> torch.Tensor | None:
            return bias[e] if _is_real(bias) else None

        gate_up: list[Panels] = []
        down: list[Panels] = []
        for e in range(num_experts):
            gu_bias, d_bias = bias_row(experts.gate_up_bias, e), bias_row(experts.down_bias, e)
            if quantized_gate_up is not None:
                gate_up.append(_with_bias(quantized_gate_up[e], gu_bias))
            else:
                gate_up.append(PackedWeight.pack(experts.gate_up[e].detach(), gu_bias, dtype))
            if quantized_down is not None:
                down.append(_with_bias(quantized_down[e], d_bias))
            else:
                down.append(PackedWeight.pack(experts.down[e].detach(), d_bias, dtype))
        return gate_up, down

    @classmethod
    def from_experts(cls, experts: Experts, dtype: torch.dtype, kernels: ModuleType, isa: int,
                     huge_pages: bool = False) -> PackedExperts:
        gate_up, down = cls.panels_of(experts, dtype)
        if huge_pages:  # before the op binds the panels' addresses
            place_on_huge_pages(gate_up + down)  # both kinds keep their panels in .data
        hidden_size = gate_up[0].in_features
        return cls(experts.cfg, hidden_size, gate_up, down, kernels, isa)

    def routed_bytes(self, expert_ids: torch.Tensor) -> int:
        """Bytes of panels a call with these routes reads: each routed expert's gate_up and down once."""
        return sum(self.gate_up_panels[e].num_bytes + self.down_panels[e].num_bytes
                   for e in expert_ids.unique().tolist())

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # x: [T, H]; expert_ids: [T, k] int64; weights: [T, k] -> [T, H] in x's dtype
        out = self.op.forward(x, expert_ids, weights).to(x.dtype)
        self.num_touched = self.op.last_num_routed
        return out


def pack_moe_experts(model: nn.Module, dtype: torch.dtype, kernels: ModuleType, isa: int,
                     huge_pages: bool = False) -> list[PackedExperts]:
    """Swap every SparseMoe's experts for PackedExperts (the CPU backend, after loading)."""
    packed = []
    for module in model.modules():
        if isinstance(module, SparseMoe) and isinstance(module.experts, Experts):
            module.experts = PackedExperts.from_experts(module.experts, dtype, kernels, isa, huge_pages)
            packed.append(module.experts)
    return packed
