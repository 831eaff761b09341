"""The CUDA backend's elementwise layers: RMS norms (with the residual add before one), RoPE's
rotation with the K/V cache writes, and SiLU(gate) * up, as one Triton kernel each (engine/execution/triton/pointwise.py) in place of torch's several.

Why: a batch-1 decode step of a small model on a GPU, replayed from a CUDA graph, is bound by how
many kernels it runs (each takes a few microseconds however little it does), and torch's ops
make some 40 a layer, 30 of them for these three parts. The modules here are drop-in subclasses
of the model's own, swapped in after loading as the CPU backend swaps its Linears, so the model
code never asks which backend runs it.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.execution.models.layers import GatedActivation, RMSNorm, Rotation

# Each forward imports the kernels' module when called: importing it imports triton, which the
# tests must first do under the interpreter (tests/engine/execution/triton).


class TritonRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from engine.execution.triton import pointwise

        if x.dim() not in (2, 3) or x.stride(-1) != 1:
            return super().forward(x)
        return pointwise.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, residual: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from engine.execution.triton import pointwise

        if x.dim() != 2 or residual.shape != x.shape or residual.dtype != x.dtype or x.stride(-1) != 1 or \
                residual.stride(-1) != 1:
            return super().add_and_norm(residual, x)
        return pointwise.add_rms_norm(residual, x, self.weight, self.eps)


class TritonRotation(Rotation):
    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        from engine.execution.triton import pointwise

        if q.dim() != 3 or k.dim() != 3 or q.stride(-1) != 1 or k.stride(-1) != 1:
            return super().forward(q, k, cos, sin)
        pointwise.rotary(q, k, cos, sin)  # in place: q and k are the step's own (views of its QKV rows)
        return q, k

    def rotate_and_cache(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from engine.execution.triton import pointwise

        if q.dim() != 3 or k.dim() != 3 or q.stride(-1) != 1 or k.stride(-1) != 1 or \
                pointwise.cache_write_problem(k, v, k_cache, v_cache, slot_mapping) is not None:
            return super().rotate_and_cache(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
        pointwise.rotary(q, k, cos, sin, v, k_cache, v_cache, slot_mapping)  # one launch: rotation and both writes
        return q, k


class TritonSiluAndMul(GatedActivation):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        from engine.execution.triton import pointwise

        return pointwise.silu_and_mul(gate_up)


def swap_pointwise_modules(model: nn.Module) -> int:
    """Replace the model's RMSNorm, Rotation and SiLU GatedActivation modules (exactly those
    classes: a family's own variants stay) with the Triton ones, in place; returns how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            replacement: nn.Module | None = None
            if type(child) is RMSNorm:
                replacement = TritonRMSNorm(child.weight.shape[0], child.eps)
                replacement.weight = child.weight
            elif type(child) is Rotation:
                replacement = TritonRotation()
            elif type(child) is GatedActivation and child.hidden_act == "silu":
                replacement = TritonSiluAndMul(child.hidden_act, child.intermediate_size)
            if replacement is not None:
                replacement.train(child.training)
                setattr(parent, name, replacement)
                swapped += 1
    return swapped
