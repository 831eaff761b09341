"""bench.kquants writes Q4_K, Q5_K and Q6_K blocks that the `gguf` package's own dequantization reads
back as the weights, within each format's rounding: the layouts (ggml's block_q4_K,
block_q5_K and block_q6_K) are the package's, bit for bit, or the values come back scrambled."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from bench.kquants import quantize_q4_k, quantize_q5_k, quantize_q6_k

T = GGMLQuantizationType


@pytest.mark.parametrize(("quant_type", "quantizer", "max_rms"), [(T.Q4_K, quantize_q4_k, 0.1),
                                                                    (T.Q5_K, quantize_q5_k, 0.05),
                                                                    (T.Q6_K, quantize_q6_k, 0.03)],
                         ids=["Q4_K", "Q5_K", "Q6_K"])
def test_blocks_dequantize_back_to_the_weights(quant_type, quantizer, max_rms: float) -> None:
    rng = np.random.default_rng(0)
    weights = (rng.standard_normal((6, 3 * 256)) * 0.05).astype(np.float32)
    weights[1] += 0.1  # all positive: Q4_K's minimum at zero
    weights[2, :256] = 0  # an all-zero block: zero scales, no division by them
    weights[3, 5] = 2.0  # an outlier: one sub-block's scale far above the rest
    blocks = quantizer(weights)
    size, nbytes = GGML_QUANT_SIZES[quant_type]
    assert blocks.dtype == np.uint8 and blocks.shape == (6, 3 * 256 // size * nbytes)
    back = dequantize(blocks, quant_type).reshape(weights.shape)
    assert np.all(back[2, :256] == 0)
    assert abs(back[3, 5] - 2.0) < 0.05
    # the outlier's block trades its small weights' precision for the outlier (one scale a block)
    kept = np.ones(weights.shape, bool)
    kept[2, :256] = kept[3, :256] = False  # the zero block (checked above) and the outlier's
    error = (back - weights)[kept].reshape(-1, 256)
    rms = np.sqrt(np.mean(error ** 2, axis=1) / np.mean(weights[kept].reshape(-1, 256) ** 2, axis=1))
    assert rms.max() < max_rms, rms


def test_rows_of_another_length_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_q4_k(np.zeros((2, 576), np.float32))
    with pytest.raises(ValueError, match="Q5_K needs .* multiple of 256"):
        quantize_q5_k(np.zeros((2, 576), np.float32))
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_q6_k(np.zeros((2, 576), np.float32))
