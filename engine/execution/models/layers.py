"""Building blocks shared by the model families: Linear, RMSNorm, RoPE's rotation, the gated
MLP's activation.

Models hold plain modules; a backend that runs them in another form (the CPU backend's panels
and oneDNN packing, engine/execution/backends/cpu_linear.py; the CUDA backend's Triton kernels
for the elementwise parts, cuda_pointwise.py) swaps them for its own after loading, so the model
code never asks which backend runs it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.execution.attention import write_kv


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)

    def forward_float(self, x: torch.Tensor) -> torch.Tensor:
        """The product in float32 (logits)."""
        return F.linear(x, self.weight, self.bias).float()

    def forward_rounded(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T + b for a consumer that reads it in the weight's dtype anyway (a bfloat16 encoder's
        fused QKV, which its attention multiplies in bfloat16): here in that dtype; the CPU
        backend's panels on AMX round each output tile as it is computed, elsewhere they give
        what forward gives."""
        return self(x.to(self.weight.dtype))

    def forward_gelu(self, x: torch.Tensor, approximate: str) -> torch.Tensor:
        """GELU(x W^T + b), approximate "none" or "tanh" (an encoder's up projection); the CPU
        backend's panels apply the GELU to each output tile as it is computed."""
        return F.gelu(self(x), approximate=approximate)

    def forward_add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """norm(residual + x W^T + b): a post-LayerNorm block's output projection, residual add
        and norm (BERT's). residual may be overwritten by the result (the CPU backend's panels
        accumulate into it and norm it in place), so a caller passes one it no longer needs."""
        return norm(residual + self(x))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_and_norm(self, residual: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """residual + x, and its norm (a subclass may do both in one pass)."""
        total = residual + x
        return total, self(total)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rotation(nn.Module):
    """RoPE's rotation (rotate-half) of a step's q and k by each token's cos and sin."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, Hq, D], k: [T, Hk, D], cos, sin: [T, 1, D] -> rotated q, k (a subclass may rotate in place)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    def rotate_and_cache(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotation, then the step's rotated K and its V written at their slots
        (attention.write_kv); returns the rotated q, k."""
        q, k = self(q, k, cos, sin)
        write_kv(k_cache, v_cache, k, v, slot_mapping)
        return q, k


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class GatedActivation(nn.Module):
    """A gated MLP's act(gate) * up, from the gate/up product [T, 2 I] -> [T, I]."""

    def __init__(self, hidden_act: str, intermediate_size: int) -> None:
        super().__init__()
        self.hidden_act, self.intermediate_size = hidden_act, intermediate_size
        self.act = ACTIVATIONS[hidden_act]

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.act(gate) * up
