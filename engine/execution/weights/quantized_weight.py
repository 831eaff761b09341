"""A projection's GGUF blocks repacked for the C++ integer-dot kernels: panels of 16 output channels.

Layout [ceil(N / 16), records, record bytes] uint8 (engine/execution/kernels/quant_tiles.h draws
it): a panel is one stream of records, one per GGUF block (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4: 32 k) or
super-block (Q4_K, Q5_K, Q6_K: 256 k) of its 16 rows, the scales first (the file's float16s, 16 a
field; MXFP4's E8M0 bytes), then the codes in 64-byte groups of 4 k x 16 rows, one vpdpbusd operand
each (5- and 6-bit codes: their low 4 bits as 4-bit codes, then groups of their top bits; MXFP4's
4-bit codes as they are, turned into values by the kernels' table lookup). The codes and scales are
the file's, moved, never turned into floats and back: `dequantize()` gives exactly the floats the
`gguf` package dequantizes the file's blocks to. Bytes per weight equal the file's: Q4_K's and
Q5_K's 6-bit scales and minimums stay 6 bits (their low nibbles, then their top 2 bits, in 192
bytes a record), so a record is 16 of the file's blocks, byte for byte in count.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch
from gguf import GGMLQuantizationType

from engine.execution.weights.ggml_blocks import FIVE_BIT_TYPES, QK, BlockFields, dequantize_fields, split_blocks

PANEL = 16
PACK_ROWS = 4096  # rows repacked at a time (a multiple of PANEL)
_T = GGMLQuantizationType


def _rows_of_panels(a: np.ndarray, per_record: int) -> np.ndarray:
    """[N_pad, records * per_record] -> [P, records, per_record * 16]: each record's values of the
    panel's 16 rows side by side (row fastest)."""
    num_rows, width = a.shape
    a = a.reshape(num_rows // PANEL, PANEL, width // per_record, per_record).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(a).reshape(num_rows // PANEL, width // per_record, per_record * PANEL)


def _panel_rows(a: np.ndarray, per_record: int, dtype: np.dtype) -> np.ndarray:
    """_rows_of_panels' inverse: [P, records, per_record * 16 * itemsize] bytes -> [N_pad, records * per_record]."""
    num_panels, records, _ = a.shape
    a = np.ascontiguousarray(a).view(dtype).reshape(num_panels, records, per_record, PANEL).transpose(0, 3, 1, 2)
    return a.reshape(num_panels * PANEL, records * per_record)


def _pack_sub_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Q4_K's and Q5_K's 6-bit scales and minimums, [P, records, 128] each (byte 16 j + r: row r's
    of sub-block j) -> [P, records, 192]: 128 bytes of low nibbles (the scale's low, the minimum's
    high), then 64 of top bits (byte 16 (j % 4) + r: bits 0-1 the scale's and 2-3 the minimum's for
    j < 4, 4-5 and 6-7 for j + 4), as quant_tiles.h draws them."""
    low = (sc & 0x0F) | ((mn & 0x0F) << 4)
    top_sc, top_mn = ((a >> 4).reshape(*a.shape[:-1], 2, 64) for a in (sc, mn))  # (..., j // 4, 16 (j % 4) + r)
    top = top_sc[..., 0, :] | (top_mn[..., 0, :] << 2) | (top_sc[..., 1, :] << 4) | (top_mn[..., 1, :] << 6)
    return np.concatenate([low, top], axis=-1)


def _unpack_sub_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """_pack_sub_scales' inverse: [P, records, 192] -> the scales and the minimums, [P, records, 128] each."""
    low, top = packed[..., :128], packed[..., 128:]
    top_sc = np.concatenate([top & 3, (top >> 4) & 3], axis=-1)
    top_mn = np.concatenate([(top >> 2) & 3, top >> 6], axis=-1)
    return (low & 0x0F) | (top_sc << 4), (low >> 4) | (top_mn << 4)


def _pack_codes(codes: np.ndarray, quant_type: GGMLQuantizationType) -> np.ndarray:
    """codes [N_pad, K] -> [P, K / 32, block bytes]: each 32-k block's 64-byte groups (t, row, i)."""
    num_rows, k = codes.shape
    p, nb = num_rows // PANEL, k // QK
    if quant_type == _T.Q8_0:  # group t: k = 4t + i
        return np.ascontiguousarray(codes.reshape(p, PANEL, nb, 8, 4).transpose(0, 2, 3, 1, 4)).reshape(p, nb, 512)
    c = codes.reshape(p, PANEL, nb, 2, 4, 4)  # (panel, row, block, half, t, i): k = 16 half + 4t + i
    low = (c[:, :, :, 0] & 0x0F) | ((c[:, :, :, 1] & 0x0F) << 4)  # (panel, row, block, t, i)
    low = np.ascontiguousarray(low.transpose(0, 2, 3, 1, 4)).reshape(p, nb, 256)
    if quant_type in FIVE_BIT_TYPES:  # one group of top bits: bit 4 half + t of byte (row, i)
        shifts = (4 * np.arange(2, dtype=np.uint8)[:, None] + np.arange(4, dtype=np.uint8)).reshape(2, 4, 1)
        top = np.bitwise_or.reduce((c >> 4) << shifts, axis=(3, 4))  # (panel, row, block, i)
        return np.concatenate([low, np.ascontiguousarray(top.transpose(0, 2, 1, 3)).reshape(p, nb, 64)], axis=-1)
    if quant_type != _T.Q6_K:
        return low
    top = (c >> 4).reshape(p, PANEL, nb, 2, 2, 2, 4)  # (..., half, s, t % 2, i): t = 2s + t % 2
    byte = top[:, :, :, 0, :, 0] | (top[:, :, :, 1, :, 0] << 2) | (top[:, :, :, 0, :, 1] << 4) | (top[:, :, :, 1, :, 1] << 6)
    top = np.ascontiguousarray(byte.transpose(0, 2, 3, 1, 4)).reshape(p, nb, 128)  # (panel, block, s, row, i)
    return np.concatenate([low, top], axis=-1)


def _unpack_codes(groups: np.ndarray, quant_type: GGMLQuantizationType) -> np.ndarray:
    """_pack_codes' inverse: [P, K / 32, block bytes] -> [N_pad, K]."""
    p, nb, _ = groups.shape
    if quant_type == _T.Q8_0:
        return groups.reshape(p, nb, 8, PANEL, 4).transpose(0, 3, 1, 2, 4).reshape(p * PANEL, nb * QK)
    low = groups[..., :256].reshape(p, nb, 4, PANEL, 4)  # (panel, block, t, row, i)
    c = np.stack([low & 0x0F, low >> 4], axis=2)  # (panel, block, half, t, row, i)
    if quant_type in FIVE_BIT_TYPES:
        top = groups[..., 256:].reshape(p, nb, 1, 1, PANEL, 4)  # (panel, block, -, -, row, i)
        shifts = (4 * np.arange(2, dtype=np.uint8)[:, None] + np.arange(4, dtype=np.uint8)).reshape(2, 4, 1, 1)
        c = c | (((top >> shifts) & 1) << 4)
    if quant_type == _T.Q6_K:
        top = groups[..., 256:].reshape(p, nb, 2, PANEL, 4)  # (panel, block, s, row, i)
        bits = [(top >> shift) & 3 for shift in (0, 2, 4, 6)]  # (half, t % 2): (0, 0) (1, 0) (0, 1) (1, 1)
        pairs = np.stack([np.stack([bits[0], bits[2]], axis=3), np.stack([bits[1], bits[3]], axis=3)], axis=2)
        c = c | (pairs.reshape(p, nb, 2, 4, PANEL, 4) << 4)  # (panel, block, half, s, t % 2, ...) -> t
    return c.transpose(0, 4, 1, 2, 3, 5).reshape(p * PANEL, nb * QK)


@dataclass(slots=True)
class QuantizedWeight:
    data: torch.Tensor  # [ceil(N / 16), records, record bytes] uint8
    quant_type: GGMLQuantizationType
    bias: torch.Tensor | None  # [N] float32
    out_features: int
    in_features: int

    @classmethod
    def pack(cls, blocks: np.ndarray | torch.Tensor, quant_type: int, in_features: int,
             bias: torch.Tensor | None = None) -> QuantizedWeight:
        """blocks: [N, row bytes] uint8, the file's blocks of each output channel's in_features."""
        if isinstance(blocks, torch.Tensor):
            blocks = blocks.numpy()
        blocks = np.asarray(blocks)
        num_rows = blocks.shape[0]
        if num_rows <= PACK_ROWS:
            return cls.from_fields(split_blocks(blocks, quant_type, in_features), bias)
        # Panels are independent: a large projection (an embedding of 150,000 rows) is repacked
        # PACK_ROWS rows at a time into its panels, so the fields and their padded and reordered
        # copies exist for one chunk, not the whole (three times the tensor at once).
        first = cls.from_fields(split_blocks(blocks[:PACK_ROWS], quant_type, in_features), bias)
        data = torch.empty((-(-num_rows // PANEL), *first.data.shape[1:]), dtype=torch.uint8)
        data[: PACK_ROWS // PANEL] = first.data
        for start in range(PACK_ROWS, num_rows, PACK_ROWS):
            part = cls.from_fields(split_blocks(blocks[start:start + PACK_ROWS], quant_type, in_features)).data
            data[start // PANEL : start // PANEL + part.shape[0]] = part
        return cls(data, first.quant_type, first.bias, num_rows, first.in_features)

    @classmethod
    def from_fields(cls, f: BlockFields, bias: torch.Tensor | None = None) -> QuantizedWeight:
        n, k = f.shape
        num_panels = -(-n // PANEL)

        def padded(a: np.ndarray) -> np.ndarray:  # [N, ...] -> [P * 16, ...], zero rows after N
            out = np.zeros((num_panels * PANEL, *a.shape[1:]), dtype=a.dtype)
            out[:n] = a
            return out

        records = f.d.shape[1]  # a record holds one of the file's blocks (32 k; 256 for the k-quants)
        parts = [_rows_of_panels(padded(f.d), 1).view(np.uint8)]
        if f.quant_type in (_T.Q4_1, _T.Q5_1):
            parts.append(_rows_of_panels(padded(f.m), 1).view(np.uint8))
        if f.quant_type in (_T.Q4_K, _T.Q5_K):
            parts += [_rows_of_panels(padded(f.dmin), 1).view(np.uint8),
                      _pack_sub_scales(_rows_of_panels(padded(f.sc), 8), _rows_of_panels(padded(f.mn), 8))]
        if f.quant_type == _T.Q6_K:
            parts.append(_rows_of_panels(padded(f.sc), 16).view(np.uint8))
        codes = _pack_codes(padded(f.codes), f.quant_type)
        parts.append(codes.reshape(num_panels, records, -1))
        data = torch.from_numpy(np.concatenate(parts, axis=-1))
        return cls(data, f.quant_type, None if bias is None else bias.detach().float().clone(), n, k)

    def fields(self) -> BlockFields:
        """The file's fields back from the panels (what `dequantize` reads)."""
        t, n = self.quant_type, self.out_features
        data = self.data.numpy()
        num_panels, records, _ = data.shape
        offset = 0

        def take(per_record: int, dtype: np.dtype) -> np.ndarray:
            nonlocal offset
            width = per_record * PANEL * np.dtype(dtype).itemsize
            values = _panel_rows(data[..., offset:offset + width], per_record, dtype)[:n]
            offset += width
            return values

        f = BlockFields(t, np.empty(0), take(1, np.uint8 if t == _T.MXFP4 else np.float16))
        if t in (_T.Q4_1, _T.Q5_1):
            f.m = take(1, np.float16)
        if t in (_T.Q4_K, _T.Q5_K):
            f.dmin = take(1, np.float16)
            sc, mn = _unpack_sub_scales(data[..., offset:offset + 192])
            offset += 192
            f.sc, f.mn = (_panel_rows(a, 8, np.uint8)[:n] for a in (sc, mn))
        if t == _T.Q6_K:
            f.sc = take(16, np.int8)
        groups = data[..., offset:].reshape(num_panels, self.in_features // QK, -1)
        f.codes = _unpack_codes(groups, t)[:n]
        return f

    @property
    def num_bytes(self) -> int:
        extra = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.data.numel() * self.data.element_size() + extra

    def as_args(self) -> tuple[torch.Tensor, int, torch.Tensor | None, int]:
        """What the C++ kernels take for one projection (quant_linear's weight arguments)."""
        return self.data, int(self.quant_type), self.bias, self.out_features

    def dequantize(self) -> torch.Tensor:
        """The [N, K] float32 matrix these panels hold: the `gguf` package's dequantization of the
        file's blocks, float for float (tests)."""
        return torch.from_numpy(dequantize_fields(self.fields()))

    def linear(self, x: torch.Tensor, kernels: ModuleType, isa: int) -> torch.Tensor:
        """x [M, K] -> [M, N] float32."""
        return kernels.quant_linear(x, *self.as_args(), isa)
