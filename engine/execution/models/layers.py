"""Building blocks shared by the model families: Linear, RMSNorm, RoPE's rotation.

Models hold plain Linears; a backend that runs weights in another form (the CPU backend's
panels and oneDNN packing, engine/execution/backends/cpu_linear.py) swaps them for its own
modules after loading, so the model code never asks which backend runs it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class Activation:
    """An elementwise activation, named as oneDNN's fused post-ops name it (attr, and algorithm
    for GELU: "none" exact erf, "tanh" the approximation), so a packed projection can apply it
    while its output is still in cache."""

    attr: str  # "gelu" or "relu"
    algorithm: str = ""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.attr == "gelu":
            return F.gelu(x, approximate=self.algorithm)
        return F.relu(x)


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)

    def forward_float(self, x: torch.Tensor) -> torch.Tensor:
        """The product in float32 (logits)."""
        return F.linear(x, self.weight, self.bias).float()

    def forward_activated(self, x: torch.Tensor, activation: Activation) -> torch.Tensor:
        """activation(x W^T + b): the CPU backend's packed form applies it inside the product."""
        return activation(F.linear(x, self.weight, self.bias))

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """x W^T + b + residual (a residual block's sum; the packed form adds it in the product)."""
        return F.linear(x, self.weight, self.bias).add_(residual)


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


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
