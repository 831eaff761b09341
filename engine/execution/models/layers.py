"""Building blocks shared by the model families: a packable Linear, RMSNorm, RoPE's rotation."""
from __future__ import annotations

import logging
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.execution.models.packed_weight import PackedWeight

logger = logging.getLogger(__name__)


class Linear(nn.Linear):
    """nn.Linear with up to two packed forms of its weight, for the CPU.

    - oneDNN, pre-reordered (`pack`): torch's default CPU GEMM can be held to an older
      instruction set by the BLAS build or its environment, while oneDNN picks its kernels for
      the CPU it runs on; with the weight packed once it was 3.5x faster in fp32 at batch 32 on
      our 2-core AVX-512 machine. Used for prefill and large batches (compute bound).
    - panels for the C++ small-batch kernels (`pack_panels`, PackedWeight): the weight read
      once at memory speed, in float32, bfloat16 or int8. Used for inputs of at most
      `max_panel_rows` rows, and for every input when they are the only copy (int8).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.packed_weight: torch.Tensor | None = None
        self.panels: PackedWeight | None = None
        self.kernels: ModuleType | None = None  # with panels: the C++ kernels and SIMD path that run them
        self.isa = 0
        self.max_panel_rows = 0

    def pack(self, drop_weight: bool) -> None:
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
        if drop_weight:  # the packed copy is all the forward needs
            self.drop_weight()

    def pack_panels(self, dtype: torch.dtype, kernels: ModuleType, isa: int, max_panel_rows: int) -> None:
        self.panels = PackedWeight.pack(self.weight.detach(), self.bias, dtype)
        self.kernels, self.isa, self.max_panel_rows = kernels, isa, max_panel_rows

    def drop_weight(self) -> None:
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def uses_panels(self, num_rows: int) -> bool:
        return self.panels is not None and (num_rows <= self.max_panel_rows or self.packed_weight is None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_float(x).to(x.dtype) if self.uses_panels(x.shape[0]) else self._forward_native(x)

    def forward_float(self, x: torch.Tensor) -> torch.Tensor:
        """The product in float32 (logits): the panels' own output, not rounded to x's dtype and back."""
        if self.uses_panels(x.shape[0]):
            return self.panels.linear(x, self.kernels, self.isa)
        return self._forward_native(x).float()

    def _forward_native(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def can_pack_linear(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed GEMM works on this CPU and build and agrees with F.linear."""
    try:
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(96, 80, generator=gen).to(dtype)
        x = torch.randn(3, 80, generator=gen).to(dtype)
        packed = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(weight), None,
                                                    "none", [], "")
        tol = 1e-3 if dtype == torch.float32 else 5e-2
        if not torch.allclose(packed, F.linear(x, weight), rtol=tol, atol=tol):
            raise RuntimeError("packed GEMM disagrees with F.linear")
        return True
    except Exception as exc:  # noqa: BLE001 - any failure means: stay on F.linear
        logger.warning("oneDNN packed linear unavailable (%s); using F.linear", exc)
        return False


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
