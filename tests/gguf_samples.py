"""GGUF test material made here, no download: random blocks of each quantized type and tiny GGUF
files written with the `gguf` package."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

T = GGMLQuantizationType
# Byte offsets of each type's float16 scale fields in its block, and each field's range: every
# other byte of a block is a code or a small integer scale, any value of which is valid.
_HALVES = {T.Q4_0: {0: (1e-3, 2e-2)}, T.Q4_1: {0: (1e-3, 2e-2), 2: (-0.1, 0.0)}, T.Q8_0: {0: (1e-3, 2e-2)},
           T.Q4_K: {0: (1e-4, 1e-3), 2: (1e-4, 1e-3)}, T.Q6_K: {208: (1e-4, 1e-3)}}


def random_blocks(quant_type: GGMLQuantizationType, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[n, row bytes] uint8: n rows of k weights in random blocks of quant_type (one of _HALVES')."""
    size, nbytes = GGML_QUANT_SIZES[quant_type]
    blocks = rng.integers(0, 256, size=(n, k // size, nbytes), dtype=np.uint8)
    for offset, (low, high) in _HALVES[quant_type].items():
        values = rng.uniform(low, high, size=(n, k // size)).astype(np.float16)
        blocks[..., offset:offset + 2] = values.view(np.uint8).reshape(n, k // size, 2)
    return blocks.reshape(n, -1)


def write_gguf(path: Path, architecture: str, metadata: dict[str, int],
               tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]]) -> Path:
    """A GGUF file of `architecture` with integer metadata (keys without the architecture's prefix)
    and tensors: name -> (blocks [N, row bytes] uint8 of a quantized type, or float values)."""
    writer = GGUFWriter(str(path), architecture)
    for key, value in metadata.items():
        writer.add_uint32(f"{architecture}.{key}", value)
    for name, (data, quant_type) in tensors.items():
        if quant_type in (T.F32, T.F16):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=quant_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
