"""Random GGUF blocks of each type the kernels run, for the kernel benchmarks and the tests: codes
and small integer scales take any byte; the float16 scale fields take small values, and MXFP4's
E8M0 scale bytes exponents of the same sizes, so that products stay finite (speed depends on the
shapes, not the values)."""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType
# Byte offsets of each type's float16 scale fields in its block, and each field's range.
_HALVES = {T.Q4_0: {0: (1e-3, 2e-2)}, T.Q4_1: {0: (1e-3, 2e-2), 2: (-0.1, 0.0)}, T.Q8_0: {0: (1e-3, 2e-2)},
           T.Q5_0: {0: (1e-3, 1e-2)}, T.Q5_1: {0: (1e-3, 1e-2), 2: (-0.1, 0.0)},
           T.Q4_K: {0: (1e-4, 1e-3), 2: (1e-4, 1e-3)}, T.Q5_K: {0: (1e-4, 1e-3), 2: (1e-4, 1e-3)},
           T.Q6_K: {208: (1e-4, 1e-3)}}
# Byte offsets of each type's E8M0 scale bytes in its block, and their range: MXFP4's 2^(e - 128)
# from 2^-12 to 2^-6, so that its largest value (12 of them) is at most 0.19.
_EXPONENTS = {T.MXFP4: {0: (116, 122)}}


def random_blocks(quant_type: GGMLQuantizationType, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[n, row bytes] uint8: n rows of k weights in random blocks of quant_type (one of _HALVES' or _EXPONENTS')."""
    size, nbytes = GGML_QUANT_SIZES[quant_type]
    blocks = rng.integers(0, 256, size=(n, k // size, nbytes), dtype=np.uint8)
    for offset, (low, high) in _EXPONENTS.get(quant_type, {}).items():
        blocks[..., offset] = rng.integers(low, high + 1, size=(n, k // size), dtype=np.uint8)
    for offset, (low, high) in _HALVES.get(quant_type, {}).items():
        values = rng.uniform(low, high, size=(n, k // size)).astype(np.float16)
        blocks[..., offset:offset + 2] = values.view(np.uint8).reshape(n, k // size, 2)
    return blocks.reshape(n, -1)


def scale_bytes(quant_type: GGMLQuantizationType) -> np.ndarray:
    """[block bytes] bool: the bytes of quant_type's block that hold its float16 or E8M0 scales (the
    rest hold codes and small integer scales, any byte each)."""
    is_scale = np.zeros(GGML_QUANT_SIZES[quant_type][1], dtype=bool)
    for offset in _HALVES.get(quant_type, {}):
        is_scale[offset:offset + 2] = True
    for offset in _EXPONENTS.get(quant_type, {}):
        is_scale[offset] = True
    return is_scale
