"""Q4_K, Q5_K and Q6_K blocks from float weights, for files the benchmarks and tests make themselves:
the `gguf` package dequantizes k-quants but cannot write them, and llama.cpp's quantizer lives
only in the peer's venv. A plain round-to-nearest per sub-block (llama.cpp searches its scales
for a smaller error; the layout is the same), checked against `gguf.quants.dequantize`.

Layouts (ggml's block_q4_K, block_q5_K and block_q6_K, 256 weights a block):
  Q4_K: d f16, dmin f16, 12 bytes of 6-bit scales and minimums (8 of each, one per 32
        weights), 128 bytes of 4-bit codes: w = d * sc * q - dmin * m.
  Q5_K: Q4_K's, with 32 bytes of the codes' top bits before the 4-bit codes (bit j of byte i:
        sub-block j's weight i): q 0..31.
  Q6_K: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales (one per 16 weights),
        d f16: w = d * sc * (q - 32).
"""
from __future__ import annotations

import numpy as np

QK_K = 256


def _halves(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """values rounded to float16 (as the file stores them) and back to float32."""
    half = values.astype(np.float16)
    return half, half.astype(np.float32)


def _ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    return np.divide(numerator, denominator, out=np.zeros_like(numerator), where=denominator != 0)


def _min_scaled(weights: np.ndarray, name: str, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's common part: [rows, k] -> (d, dmin f16 and the 12 bytes of 6-bit scales
    and minimums: [blocks, 16] uint8; codes [blocks, 8, 32] uint8 in 0..levels)."""
    rows, k = weights.shape
    if k % QK_K:
        raise ValueError(f"{name} needs a row length that is a multiple of {QK_K}, got {k}")
    x = weights.astype(np.float32).reshape(-1, 8, 32)  # [blocks, sub-blocks, 32]
    low = np.minimum(x.min(axis=-1), 0)
    scale = (x.max(axis=-1) - low) / levels  # [blocks, 8]
    d16, d = _halves(scale.max(axis=-1) / 63)
    dmin16, dmin = _halves(-low.min(axis=-1) / 63)
    sc = np.clip(np.rint(_ratio(scale, d[:, None])), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_ratio(-low, dmin[:, None])), 0, 63).astype(np.uint8)
    step = d[:, None] * sc
    q = np.clip(np.rint(_ratio(x + (dmin[:, None] * mn)[..., None], step[..., None])), 0, levels).astype(np.uint8)
    packed = np.empty((x.shape[0], 12), np.uint8)
    packed[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    header = np.concatenate([d16.view(np.uint8).reshape(-1, 2), dmin16.view(np.uint8).reshape(-1, 2), packed], axis=1)
    return header, q


def _nibble_runs(q: np.ndarray) -> np.ndarray:
    """codes [blocks, 8, 32] -> [blocks, 128]: 64 weights a byte run, sub-block 2j in the low
    nibbles, 2j + 1 in the high ones (their low 4 bits)."""
    pairs = q.reshape(-1, 4, 2, 32) & 0x0F
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)


def quantize_q4_k(weights: np.ndarray) -> np.ndarray:
    """[rows, k] float -> [rows, k / 256 * 144] uint8 (k a multiple of 256)."""
    header, q = _min_scaled(weights, "Q4_K", 15)
    return np.concatenate([header, _nibble_runs(q)], axis=1).reshape(weights.shape[0], -1)


def quantize_q5_k(weights: np.ndarray) -> np.ndarray:
    """[rows, k] float -> [rows, k / 256 * 176] uint8 (k a multiple of 256)."""
    header, q = _min_scaled(weights, "Q5_K", 31)
    # 32 bytes of top bits: bit j of byte i is sub-block j's element i
    qh = np.bitwise_or.reduce((q >> 4) << np.arange(8, dtype=np.uint8).reshape(8, 1), axis=1)  # [blocks, 32]
    return np.concatenate([header, qh, _nibble_runs(q)], axis=1).reshape(weights.shape[0], -1)


def quantize_q6_k(weights: np.ndarray) -> np.ndarray:
    """[rows, k] float -> [rows, k / 256 * 210] uint8 (k a multiple of 256)."""
    rows, k = weights.shape
    if k % QK_K:
        raise ValueError(f"Q6_K needs a row length that is a multiple of {QK_K}, got {k}")
    x = weights.astype(np.float32).reshape(-1, 16, 16)  # [blocks, sub-blocks, 16]
    scale = np.abs(x).max(axis=-1) / 31  # [blocks, 16]
    d16, d = _halves(scale.max(axis=-1) / 127)
    sc = np.clip(np.rint(_ratio(scale, d[:, None])), 0, 127).astype(np.int8)
    step = d[:, None] * sc
    q = (np.clip(np.rint(_ratio(x, step[..., None])), -32, 31) + 32).astype(np.uint8)
    # two halves of 128; within one, weights l, l + 32, l + 64, l + 96 share their code bytes
    parts = q.reshape(-1, 2, 4, 32)
    a, b, c, e = (parts[:, :, i] for i in range(4))
    ql = np.concatenate([(a & 0xF) | ((c & 0xF) << 4), (b & 0xF) | ((e & 0xF) << 4)], axis=-1)  # [blocks, 2, 64]
    qh = (a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6)  # [blocks, 2, 32]
    blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8),
                             d16.view(np.uint8).reshape(-1, 2)], axis=1)
    return blocks.reshape(rows, -1)
