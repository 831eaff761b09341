"""Building blocks shared by the model families: Linear, RMSNorm, RoPE's rotation.

Models hold plain Linears; a backend that runs weights in another form (the CPU backend's
panels and oneDNN packing, engine/execution/backends/cpu_linear.py) swaps them for its own
modules after loading, so the model code never asks which backend runs it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)

    def forward_float(self, x: torch.Tensor) -> torch.Tensor:
        """The product in float32 (logits)."""
        return F.linear(x, self.weight, self.bias).float()

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


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
