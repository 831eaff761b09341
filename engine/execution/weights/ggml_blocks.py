"""GGUF's quantized block formats with kernels (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4): a tensor's blocks
split into their fields, codes and scales as the file stores them, and the float32 values the
fields stand for, computed in the `gguf` package's order of float32 operations so that both give
the same floats (the exact reference for these weights).

Codes are unsigned: 4-bit 0..15; 5-bit 0..31; Q6_K 0..63; Q8_0 the file's int8 plus 128. MXFP4's
4-bit codes index the E2M1 values doubled (MXFP4_VALUES: integers) and its scale is a byte, an E8M0
exponent e standing for 2^(e - 127), halved to undo the doubling: 2^(e - 128), subnormal for e < 2.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK = 32  # the kernels' block: activations are quantized per 32 k
QK_K = 256  # a k-quant super-block
_T = GGMLQuantizationType
KERNEL_TYPES = (_T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0, _T.Q4_K, _T.Q5_K, _T.Q6_K, _T.MXFP4)
FIVE_BIT_TYPES = (_T.Q5_0, _T.Q5_1, _T.Q5_K)  # 4-bit codes plus a top bit each
# MXFP4's code -> twice its E2M1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), as ggml's table
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)


@dataclass(slots=True)
class BlockFields:
    quant_type: GGMLQuantizationType
    codes: np.ndarray  # [N, K] uint8
    # [N, K / block]: the scale of each block (super-block for Q4_K, Q5_K, Q6_K), float16; MXFP4: uint8, the E8M0 byte
    d: np.ndarray
    m: np.ndarray | None = None  # Q4_1, Q5_1: [N, K / 32] float16, each block's minimum
    dmin: np.ndarray | None = None  # Q4_K, Q5_K: [N, K / 256] float16, the scale of the sub-blocks' minimums
    sc: np.ndarray | None = None  # Q4_K, Q5_K: [N, K / 32] uint8 (6 bits); Q6_K: [N, K / 16] int8
    mn: np.ndarray | None = None  # Q4_K, Q5_K: [N, K / 32] uint8 (6 bits), each sub-block's minimum

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape


def block_size(quant_type: GGMLQuantizationType) -> int:
    return GGML_QUANT_SIZES[quant_type][0]


def row_bytes(quant_type: GGMLQuantizationType, k: int) -> int:
    size, nbytes = GGML_QUANT_SIZES[quant_type]
    return k // size * nbytes


def _halves(b: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(b[..., start:start + 2]).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., n] bytes -> [..., 2n] codes: the low nibbles, then the high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """E8M0 bytes -> float32 2^(e - 128) (half the scale they stand for), bit for bit as ggml and the
    gguf package build it: subnormal 2^-128 and 2^-127 below e = 2, 2^127 at e = 255."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (np.maximum(e, 1) - 1) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 12 bytes [..., 12] -> their 8 scales and 8 minimums of 6 bits, [..., 8] each."""
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, mn


def _bits(qh: np.ndarray) -> np.ndarray:
    """[..., n] bytes -> [..., 8n] of their bits, 0 or 1, each byte's lowest first (a little-endian word's order)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def split_blocks(blocks: np.ndarray, quant_type: GGMLQuantizationType, k: int) -> BlockFields:
    """blocks: [N, row bytes] uint8, each row the file's blocks of k inputs -> their fields."""
    quant_type = GGMLQuantizationType(quant_type)
    if quant_type not in KERNEL_TYPES:
        raise ValueError(f"quant_type: no kernel for {quant_type.name}")
    size, nbytes = GGML_QUANT_SIZES[quant_type]
    if k % size != 0:
        raise ValueError(f"in_features: {k} is not a multiple of {quant_type.name}'s block of {size}")
    if blocks.dtype != np.uint8 or blocks.ndim != 2 or blocks.shape[1] != k // size * nbytes:
        raise ValueError(f"blocks: expected uint8 [N, {k // size * nbytes}] for {quant_type.name} rows of {k}, "
                         f"got {blocks.dtype} {list(blocks.shape)}")
    n = blocks.shape[0]
    b = blocks.reshape(n, k // size, nbytes)  # [N, blocks, bytes]
    if quant_type == GGMLQuantizationType.Q4_0:
        return BlockFields(quant_type, _nibbles(b[..., 2:]).reshape(n, k), _halves(b, 0))
    if quant_type == GGMLQuantizationType.Q4_1:
        return BlockFields(quant_type, _nibbles(b[..., 4:]).reshape(n, k), _halves(b, 0), m=_halves(b, 2))
    if quant_type == GGMLQuantizationType.Q5_0:  # d, 32 top bits (bit i: element i), 16 bytes of nibbles
        codes = _nibbles(b[..., 6:]) | (_bits(b[..., 2:6]) << 4)
        return BlockFields(quant_type, codes.reshape(n, k), _halves(b, 0))
    if quant_type == GGMLQuantizationType.Q5_1:  # d, m, then Q5_0's codes
        codes = _nibbles(b[..., 8:]) | (_bits(b[..., 4:8]) << 4)
        return BlockFields(quant_type, codes.reshape(n, k), _halves(b, 0), m=_halves(b, 2))
    if quant_type == GGMLQuantizationType.Q8_0:
        return BlockFields(quant_type, (b[..., 2:] ^ 0x80).reshape(n, k), _halves(b, 0))
    if quant_type == GGMLQuantizationType.MXFP4:  # e, then Q4_0's nibble order
        return BlockFields(quant_type, _nibbles(b[..., 1:]).reshape(n, k), np.ascontiguousarray(b[..., 0]))
    if quant_type in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K):
        sc, mn = _k_scales(b[..., 4:16])  # 8 scales and 8 minimums of 6 bits in 12 bytes
        # 4 runs of 32 bytes: the low nibbles are sub-block 2c, the high ones 2c + 1
        codes = _nibbles(b[..., -128:].reshape(n, k // size, 4, 32)).reshape(n, k // size, 8, 32)
        if quant_type == GGMLQuantizationType.Q5_K:  # 32 bytes of top bits: bit j of byte i, sub-block j's element i
            top = (b[..., 16:48].reshape(n, k // size, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
            codes = codes | (top << 4)
        return BlockFields(quant_type, codes.reshape(n, k), _halves(b, 0), dmin=_halves(b, 2),
                           sc=sc.reshape(n, -1), mn=mn.reshape(n, -1))
    # Q6_K: per half of 128: low 4 bits in 64 bytes (low nibbles 0-63, high 64-127), top 2 bits
    # in 32 bytes (bit pairs 0-1, 2-3, 4-5, 6-7: elements 0-31, 32-63, 64-95, 96-127)
    low = _nibbles(b[..., :128].reshape(n, k // size, 2, 64))
    qh = b[..., 128:192].reshape(n, k // size, 2, 1, 32)
    top = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 3
    codes = low | (top.reshape(n, k // size, 2, 128) << 4)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8)
    return BlockFields(quant_type, codes.reshape(n, k), _halves(b, 208), sc=sc.reshape(n, -1))


def dequantize_fields(f: BlockFields) -> np.ndarray:
    """The [N, K] float32 weights, by the `gguf` package's float32 operations in its order."""
    n, k = f.shape
    t = f.quant_type
    per_block = f.codes.reshape(n, k // QK, QK)
    if t == GGMLQuantizationType.MXFP4:
        with np.errstate(over="ignore"):  # e near 255: +-inf, as the gguf package gives
            return (e8m0_half(f.d)[..., None] * MXFP4_VALUES[per_block].astype(np.float32)).reshape(n, k)
    d = f.d.astype(np.float32)
    if t in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q5_0):
        offset = np.int8(8 if t == GGMLQuantizationType.Q4_0 else 16)
        out = d[..., None] * (per_block.astype(np.int8) - offset).astype(np.float32)
    elif t in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_1):
        out = d[..., None] * per_block.astype(np.float32) + f.m.astype(np.float32)[..., None]
    elif t == GGMLQuantizationType.Q8_0:
        out = (per_block ^ 0x80).view(np.int8).astype(np.float32) * d[..., None]
    elif t in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K):
        scale = (np.repeat(d, QK_K // QK, axis=1) * f.sc.astype(np.float32))[..., None]
        minimum = (np.repeat(f.dmin.astype(np.float32), QK_K // QK, axis=1) * f.mn.astype(np.float32))[..., None]
        out = scale * per_block.astype(np.float32) - minimum
    else:  # Q6_K: sub-blocks of 16
        scale = (np.repeat(d, QK_K // 16, axis=1) * f.sc.astype(np.float32))[..., None]
        out = scale * (f.codes.reshape(n, k // 16, 16).astype(np.int8) - np.int8(32)).astype(np.float32)
    return out.reshape(n, k)
