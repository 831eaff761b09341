"""A projection's weight packed for the C++ small-batch kernels: panels of 16 output channels.

Layout [ceil(N / 16), K, 16]: each panel is one contiguous stream and each k gives 16 weights
that one broadcast of x[m, k] multiplies (engine/execution/kernels/packed_gemm.cpp says why). bfloat16
interleaves pairs of k, [ceil(N / 16), Kp / 2, 16 * 2] with K zero-padded to Kp (a multiple of
32): AMX's tile product reads that as it is. float32 and bfloat16 keep the model's values
exactly; int8 is weight-only quantization, symmetric with one float32 scale per output channel
(max |w| / 127), which halves bf16's bytes and quarters fp32's.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from engine.execution.heap_policy import release_free_memory
from engine.execution.huge_pages import huge_page_tensor

PANEL = 16
PAIR_CHUNK = 32  # bfloat16 panels pad K to a multiple of this (one AMX tile's k)
PAGE_BYTES = 4096  # each weight starts on a page of its own in the shared region
_TRIM_BYTES = 256 << 20  # bytes moved to the region between returns of the freed ones to the OS


@dataclass(slots=True)
class PackedWeight:
    data: torch.Tensor  # [ceil(N / 16), K, 16] float32 | int8; [ceil(N / 16), Kp / 2, 32] bfloat16
    scales: torch.Tensor | None  # [ceil(N / 16) * 16] float32 (int8 only)
    bias: torch.Tensor | None  # [N] float32
    out_features: int
    in_features: int

    @classmethod
    def pack(cls, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> PackedWeight:
        """weight: [N, K] -> panels of `dtype` (float32, bfloat16 or int8)."""
        if dtype not in (torch.float32, torch.bfloat16, torch.int8):
            raise ValueError(f"packed weights are float32, bfloat16 or int8, not {dtype}")
        n, k = weight.shape
        num_panels = -(-n // PANEL)
        padded = torch.zeros(num_panels * PANEL, k, dtype=torch.float32)
        padded[:n] = weight.float()
        scales = None
        if dtype == torch.int8:
            scales = padded.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # [N_pad]
            padded = torch.round(padded / scales.unsqueeze(1)).clamp(-127, 127)
        if dtype == torch.bfloat16:
            k_pad = -(-k // PAIR_CHUNK) * PAIR_CHUNK
            padded = torch.nn.functional.pad(padded, (0, k_pad - k))  # [N_pad, Kp]
            # [P, 16, Kp / 2, 2] -> [P, Kp / 2, 16, 2]: the 16 outputs' (k, k + 1) pairs side by side
            data = padded.to(dtype).view(num_panels, PANEL, k_pad // 2, 2).transpose(1, 2)
            data = data.reshape(num_panels, k_pad // 2, 2 * PANEL).contiguous()
        else:
            data = padded.to(dtype).view(num_panels, PANEL, k).transpose(1, 2).contiguous()
        return cls(data, scales, None if bias is None else bias.detach().float().clone(), n, k)

    @property
    def num_bytes(self) -> int:
        extra = sum(t.numel() * t.element_size() for t in (self.scales, self.bias) if t is not None)
        return self.data.numel() * self.data.element_size() + extra

    def as_args(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, int]:
        """What the C++ kernels take for one projection."""
        return self.data, self.scales, self.bias, self.out_features

    def dequantize(self) -> torch.Tensor:
        """The [N, K] float32 matrix these panels hold (what the kernels multiply by; tests)."""
        num_panels, rows, width = self.data.shape
        if width == 2 * PANEL:  # bfloat16 pairs of k: [P, Kp / 2, 16, 2] -> [P * 16, Kp]
            weight = self.data.float().view(num_panels, rows, PANEL, 2).transpose(1, 2)
            weight = weight.reshape(num_panels * PANEL, 2 * rows)[:, : self.in_features]
        else:
            weight = self.data.float().transpose(1, 2).reshape(num_panels * PANEL, rows)
        if self.scales is not None:
            weight = weight * self.scales.unsqueeze(1)
        return weight[: self.out_features]

    def linear(self, x: torch.Tensor, kernels: ModuleType, isa: int) -> torch.Tensor:
        """x [M, K] -> [M, N] float32."""
        return kernels.packed_linear(x, *self.as_args(), isa)


def place_on_huge_pages(weights: Sequence[PackedWeight]) -> torch.Tensor:
    """Move every weight's panels into one region on 2 MiB pages (engine/execution/huge_pages.py says why)
    and return it: [bytes] uint8, which each weight's `data` now views."""
    sizes = [w.data.numel() * w.data.element_size() for w in weights]
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + -(-size // PAGE_BYTES) * PAGE_BYTES)
    region = huge_page_tensor((starts[-1],), torch.uint8)
    moved = 0
    for weight, start, size in zip(weights, starts[:-1], sizes, strict=True):
        view = region[start:start + size].view(weight.data.dtype).view(weight.data.shape)
        view.copy_(weight.data)
        weight.data = view
        moved += size
        if moved >= _TRIM_BYTES:
            # The old panels are freed as they move, but malloc keeps small ones (an expert's few
            # MB) in its heap: without a trim every so often the region and the old copies were
            # resident together, twice the weights at the peak.
            release_free_memory()
            moved = 0
    return region
