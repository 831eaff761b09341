"""The CPU backend's form of a model loaded from a GGUF file (engine/execution/weights/gguf_loader.py):
each quantized projection a PackedLinear over its QuantizedWeight or, for a fused projection of
mixed block types, its QuantizedParts (the integer-dot kernels: quant_linear, or packed_linear for
parts, in a torch-path product, and the uint8 panels in the fused layers' and decode step's
projection slots, which packed_gemm hands to quant_gemm), float projections in float panels, and a quantized
embedding read row by row from its blocks (quant_rows; the decode step gathers the same panels).
"""
from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from engine.execution.backends.cpu_linear import PackedLinear
from engine.execution.models.layers import Linear
from engine.execution.weights.packed_weight import PackedWeight
from engine.execution.weights.quantized_parts import QuantizedParts
from engine.execution.weights.quantized_weight import QuantizedWeight


class QuantEmbedding(nn.Module):
    """An embedding kept in the file's blocks (its own, or the tied LM head's): rows dequantized
    on lookup, each as the gguf package dequantizes it."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype, kernels: ModuleType) -> None:
        super().__init__()
        self.weight_blocks, self.dtype, self.kernels = weight, dtype, kernels
        self.embedding_dim = weight.in_features

    @property
    def data(self) -> torch.Tensor:
        """The panels as the C++ decode step takes an embedding: [P, records, record bytes] uint8."""
        return self.weight_blocks.data

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, hidden] in the model's dtype
        w = self.weight_blocks
        rows = self.kernels.quant_rows(w.data, int(w.quant_type), input_ids.long(), w.out_features, w.in_features)
        return rows.to(self.dtype)


def pack_gguf_linears(model: nn.Module, dtype: torch.dtype, kernels: ModuleType, isa: int) -> list[PackedLinear]:
    """Swap every Linear for a PackedLinear whose panels are its QuantizedWeight (set by the GGUF
    loader) or, for a float projection, panels of `dtype`; every step runs on the panels."""
    packed = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, Linear):
                continue
            module = PackedLinear(child)
            quantized = getattr(child, "quantized", None)
            if quantized is not None:
                module.panels = quantized
                module.kernels, module.isa = kernels, isa
            else:
                module.pack_panels(dtype, kernels, isa, 0)
            module.drop_weight()
            setattr(parent, name, module)
            packed.append(module)
    return packed


def embedding_of(model: nn.Module, dtype: torch.dtype, kernels: ModuleType) -> nn.Module:
    """The model's embedding as the backend keeps it: the file's blocks where it has them."""
    quantized = getattr(model.embed_tokens, "quantized", None)
    return model.embed_tokens if quantized is None else QuantEmbedding(quantized, dtype, kernels)


def kernel_args(panels: PackedWeight | QuantizedWeight | QuantizedParts) -> tuple:
    """A projection's panels as the fused layers and the decode step take them: (data, scale,
    bias, out_features); GGUF block panels (one type's, or mixed types' parts with their header)
    are uint8 data without a scale."""
    if isinstance(panels, QuantizedWeight | QuantizedParts):
        return panels.data, None, panels.bias, panels.out_features
    return panels.as_args()
