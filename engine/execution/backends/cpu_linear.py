"""The CPU backend's projections: a Linear's weight in up to two packed forms.

- oneDNN, pre-reordered: torch's default CPU GEMM can be held to an older instruction set by
  the BLAS build or its environment, while oneDNN picks its kernels for the CPU it runs on.
  Used for prefill and large batches (compute bound).
- panels for the C++ small-batch kernels (PackedWeight): the weight read once at memory speed,
  in float32, bfloat16 or int8. Used for inputs of at most `max_panel_rows` rows, and for every
  input when they are the only copy (int8, or every step fused).
The plain weight is dropped once a packed form can stand in for it everywhere, so each weight is
resident once in the form that runs.
"""
from __future__ import annotations

import logging
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.execution.kernels import ISAS
from engine.execution.models.layers import Linear
from engine.execution.weights.packed_weight import PackedWeight

logger = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight: torch.Tensor | None = linear.weight  # None once a packed form replaces it
        self.bias = linear.bias
        self.packed_weight: torch.Tensor | None = None  # oneDNN's reordered copy
        self.panels: PackedWeight | None = None
        self.kernels: ModuleType | None = None  # with panels: the C++ kernels and SIMD path that run them
        self.isa = 0
        self.max_panel_rows = 0

    def pack_onednn(self) -> None:
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())

    def pack_panels(self, dtype: torch.dtype, kernels: ModuleType, isa: int, max_panel_rows: int) -> None:
        self.panels = PackedWeight.pack(self.weight.detach(), self.bias, dtype)
        self.kernels, self.isa, self.max_panel_rows = kernels, isa, max_panel_rows

    def drop_weight(self) -> None:
        self.weight = None

    def uses_panels(self, num_rows: int) -> bool:
        return self.panels is not None and (num_rows <= self.max_panel_rows or self.packed_weight is None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_float(x).to(x.dtype) if self.uses_panels(x.shape[0]) else self._forward_native(x)

    def forward_float(self, x: torch.Tensor) -> torch.Tensor:
        """The product in float32 (logits): the panels' own output, not rounded to x's dtype and back."""
        if self.uses_panels(x.shape[0]):
            return self.panels.linear(x, self.kernels, self.isa)
        return self._forward_native(x).float()

    def forward_rounded(self, x: torch.Tensor) -> torch.Tensor:
        # bfloat16 panels on AMX: bias and rounding in the tiles' epilogue, half the bytes of a float32
        # output and no rounding pass after it; elsewhere the float32 output (which the consumer
        # rounds as it reads it), as forward gives it
        if self._is_amx_bf16(x):
            return self.kernels.packed_linear(x, *self.panels.as_args(), self.isa, True)
        return self(x)

    def forward_gelu(self, x: torch.Tensor, approximate: str) -> torch.Tensor:
        # GELU applied to each output tile while it is in cache, not in a pass over the whole output
        # (its erf / tanh vectorized on AVX-512 only: elsewhere torch's vectorized GELU is faster).
        # bfloat16 panels on AMX: the output in bfloat16 from the tiles' epilogue, the down product's
        # left operand as that product would round it (forward_add_norm takes it as it is).
        if self._can_fuse(x) and self.isa >= ISAS["avx512"]:
            return self.kernels.packed_linear_gelu(x, self.panels.data, self.panels.bias, self.out_features, self.isa,
                                                   approximate == "tanh", self._is_amx_bf16(x))
        return F.gelu(self(x), approximate=approximate)

    def forward_add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        # The product accumulated into the residual rows, then the norm over them, in place: no
        # separate add pass and no copy of the stream.
        if self._can_fuse(x, allow_bfloat16=True) and residual.dtype == torch.float32 and residual.is_contiguous() \
                and norm.weight.dtype == torch.float32 and getattr(norm, "bias", None) is not None:
            self.kernels.packed_linear_add_norm_(x, self.panels.data, self.panels.bias, self.out_features, self.isa,
                                                 residual, norm.weight, norm.bias, norm.eps)
            return residual
        return norm(residual + self(x))

    def _can_fuse(self, x: torch.Tensor, allow_bfloat16: bool = False) -> bool:
        """Whether float32 or bfloat16 panels run x's product, x float32 (the fused epilogues'
        kernels take those: an encoder's float32 stream, its weights in either); allow_bfloat16:
        x may be bfloat16 too (forward_add_norm beside a float32 residual: the bfloat16 rows of
        forward_gelu or attention on AMX, which the product takes as they are)."""
        dtypes = (torch.float32, torch.bfloat16) if allow_bfloat16 else (torch.float32,)
        return (self.uses_panels(x.shape[0]) and self.panels.data.dtype in (torch.float32, torch.bfloat16)
                and x.dtype in dtypes)

    def _is_amx_bf16(self, x: torch.Tensor) -> bool:
        """Whether bfloat16 panels run x's product on AMX (where the tiles' epilogue writes bfloat16)."""
        return self._can_fuse(x) and self.isa >= ISAS["amx"] and self.panels.data.dtype == torch.bfloat16

    def _forward_native(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class PanelEmbedding(nn.Module):
    """A tied embedding read from the LM head's float32 or bfloat16 panels (the same values), so
    the matrix is held once: row t is panel t // 16's column t % 16."""

    def __init__(self, head: PackedLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.panels, self.dtype = head.panels, dtype
        self.embedding_dim = head.in_features

    @property
    def data(self) -> torch.Tensor:
        """The panels as the C++ decode step takes an embedding."""
        return self.panels.data

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, hidden] in the model's dtype
        data, panel, lane = self.panels.data, input_ids // 16, input_ids % 16
        if data.dtype == torch.float32:  # [P, K, 16]
            rows = data[panel, :, lane]
        else:  # bfloat16 pairs of k: [P, Kp / 2, 32] -> [T, Kp / 2, 2] -> [T, Kp]
            num_panels, num_pairs, _ = data.shape
            rows = data.view(num_panels, num_pairs, 16, 2)[panel, :, lane].reshape(len(input_ids), -1)
        return rows[:, : self.embedding_dim].to(self.dtype)


def pack_linears(model: nn.Module, onednn: bool, panel_dtype: torch.dtype | None, kernels: ModuleType | None,
                 isa: int, max_panel_rows: int, keep: tuple[nn.Module, ...] = ()) -> list[PackedLinear]:
    """Swap every Linear of model for a PackedLinear in the asked forms, dropping the plain weight
    unless a module in `keep` shares it (a tied embedding) or no packed form covers every input."""
    packed = []
    kept = {id(m.weight) for m in keep}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, Linear):
                continue
            module = PackedLinear(child)
            if panel_dtype is not None:
                module.pack_panels(panel_dtype, kernels, isa, max_panel_rows)
            if onednn:
                module.pack_onednn()
            if (onednn or panel_dtype is not None) and id(child.weight) not in kept:
                module.drop_weight()
            setattr(parent, name, module)
            packed.append(module)
    return packed


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
