"""A fused projection whose checkpoint parts are GGUF blocks of different types, each kept in its own.

llama.cpp's Q4_K_M files store V (and some layers' down) in Q6_K beside Q4_K: a fused QKV
projection of such a file is q and k rows of one type and v rows of another. Requantizing the
whole to one common type (Q8_0) would read ~7 % more bytes a token than the file holds and change
its values; here each run of rows of one type stays a QuantizedWeight of the file's blocks, and
the kernels run the runs as one product (engine/execution/kernels/cpu_kernels.h, kQuantPartsHeaderBytes):

    data: [64 + sum of the parts' panel bytes] uint8, a header of int32s (the number of parts,
    then each part's ggml type, panels, records), then each part's panels in row order.

Each part but the last must fill whole panels of 16 rows (the kernels' panel p is outputs
16 p .. 16 p + 15 whichever part holds it): `fits` says whether parts of given row counts can.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch
from gguf import GGMLQuantizationType

from engine.execution.weights.quantized_weight import PANEL, QuantizedWeight

HEADER_BYTES = 64
MAX_PARTS = 3  # the kernels' kMaxQuantParts: q, k, v


@dataclass(slots=True)
class QuantizedParts:
    data: torch.Tensor  # [HEADER_BYTES + panel bytes] uint8
    part_types: tuple[GGMLQuantizationType, ...]
    part_rows: tuple[int, ...]  # output channels of each part
    part_shapes: tuple[tuple[int, int, int], ...]  # each part's panels, [P, records, record bytes]
    bias: torch.Tensor | None  # [N] float32
    out_features: int
    in_features: int

    @staticmethod
    def fits(part_rows: Sequence[int]) -> bool:
        """Whether parts of these row counts can be served as they are: at most MAX_PARTS of them,
        each but the last whole panels."""
        return 1 <= len(part_rows) <= MAX_PARTS and all(rows % PANEL == 0 for rows in part_rows[:-1])

    @classmethod
    def of(cls, parts: Sequence[QuantizedWeight], bias: torch.Tensor | None = None) -> QuantizedParts:
        """The parts (row segments, in order, none with a bias of its own) as one projection."""
        rows = tuple(p.out_features for p in parts)
        if not cls.fits(rows):
            raise ValueError(f"parts: rows {list(rows)} are not up to {MAX_PARTS} parts of whole {PANEL}-row panels")
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("parts: every part must have the same in_features")
        header = np.zeros(HEADER_BYTES // 4, dtype=np.int32)
        header[0] = len(parts)
        for i, p in enumerate(parts):
            num_panels, num_records, _ = p.data.shape
            header[1 + 3 * i: 4 + 3 * i] = (int(p.quant_type), num_panels, num_records)
        data = torch.cat([torch.from_numpy(header).view(torch.uint8)] + [p.data.reshape(-1) for p in parts])
        return cls(data, tuple(p.quant_type for p in parts), rows, tuple(tuple(p.data.shape) for p in parts),
                   None if bias is None else bias.detach().float().clone(), sum(rows), parts[0].in_features)

    @property
    def parts(self) -> list[QuantizedWeight]:
        """Each part as a QuantizedWeight viewing `data` (no copy; without the bias)."""
        out, offset = [], HEADER_BYTES
        for quant_type, rows, shape in zip(self.part_types, self.part_rows, self.part_shapes, strict=True):
            size = int(np.prod(shape))
            panels = self.data[offset:offset + size].view(shape)
            out.append(QuantizedWeight(panels, quant_type, None, rows, self.in_features))
            offset += size
        return out

    @property
    def num_bytes(self) -> int:
        extra = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.data.numel() * self.data.element_size() + extra

    def dequantize(self) -> torch.Tensor:
        """The [N, K] float32 matrix: each part's the `gguf` package's dequantization of its blocks."""
        return torch.cat([p.dequantize() for p in self.parts])

    def linear(self, x: torch.Tensor, kernels: ModuleType, isa: int) -> torch.Tensor:
        """x [M, K] -> [M, N] float32: one product over every part's panels."""
        return kernels.packed_linear(x, self.data, None, self.bias, self.out_features, isa)
