"""What the AMX tile unit gives here, measured, not read off a datasheet: the bf16 tile product's
rate with its operands in tile registers (the unit's peak), the 2x2 register-blocked kernel the
engine's products and prefill attention use (two A tiles of 16 rows x 32 k, two B tiles of 16
pairs x 16 outputs, four float32 C tiles) over operands in L1/L2, and the same kernel storing each
32 x 32 block of sums into a wide float32 output as gemm_amx does; and a GGUF block's int8 tile
steps (quant_tiles_amx.cpp's) with and without the tile store, beside the vector scaling of
each block's sums, alone and interleaved (a tile store holds up the core's other work while it
runs). One thread and two (the GIL
released), random bf16 operands (the blocked kernel ran about 1.25x faster on zeros: its rate
depends on the data). Needs an AMX CPU and a compiler (the kernel is built inline, once).

    python -m bench.amx_peak
"""
from __future__ import annotations

import argparse
import logging
import threading
import time

import torch

logger = logging.getLogger("bench.amx_peak")

_SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

__attribute__((target("amx-tile,amx-bf16"))) void configure() {
  syscall(SYS_arch_prctl, 0x1023, 18);  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// 4 independent tile products a round on resident tiles.
__attribute__((target("amx-tile,amx-bf16"))) void resident(const torch::Tensor& operands, int64_t rounds) {
  configure();
  const auto* a = static_cast<const uint16_t*>(operands.data_ptr());
  _tile_loadd(4, a, 64);
  _tile_loadd(5, a + 512, 64);
  _tile_loadd(6, a + 1024, 64);
  _tile_loadd(7, a + 1536, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t i = 0; i < rounds; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float sink[256];
  _tile_stored(0, sink, 64);
  _tile_release();
}

// The 2x2 kernel over A [32 blocks x 32 rows, K] and B [panels, K / 2, 32] panel pair by panel
// pair, row block by row block; out: null (sums to an L1 buffer) or [32 blocks x 32 rows, N].
__attribute__((target("amx-tile,amx-bf16"))) void blocked(const torch::Tensor& A, const torch::Tensor& B, int64_t K,
                                                          int64_t num_blocks, int64_t num_panels,
                                                          std::optional<torch::Tensor> out, int64_t rounds) {
  configure();
  const auto* a = static_cast<const uint16_t*>(A.data_ptr());
  const auto* b = static_cast<const uint16_t*>(B.data_ptr());
  alignas(64) static thread_local float local[32 * 32];
  float* o = out ? out->data_ptr<float>() : nullptr;
  const int64_t N = num_panels * 16;
  for (int64_t r = 0; r < rounds; ++r) {
    for (int64_t p = 0; p < num_panels; p += 2) {
      const uint16_t* b0 = b + p * K * 16;
      const uint16_t* b1 = b0 + K * 16;
      for (int64_t m = 0; m < num_blocks; ++m) {
        const uint16_t* am = a + m * 32 * K;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k = 0; k < K; k += 32) {
          _tile_loadd(4, am + k, K * 2);
          _tile_loadd(5, am + 16 * K + k, K * 2);
          _tile_loadd(6, b0 + k * 16, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(2, 5, 6);
          _tile_loadd(7, b1 + k * 16, 64);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
        }
        float* c = o ? o + m * 32 * N + p * 16 : local;
        const int64_t ldc = (o ? N : 32) * 4;
        _tile_stored(0, c, ldc);
        _tile_stored(1, c + 16, ldc);
        _tile_stored(2, c + 16 * (ldc / 4), ldc);
        _tile_stored(3, c + 16 * (ldc / 4) + 16, ldc);
      }
    }
  }
  _tile_release();
}
// One GGUF block's int8 tile (quant_tiles_amx.cpp's steps) in L1, `rounds` x 2 blocks: the tile
// steps (zero, load 16 rows x 32 k of activations and 32 k x 16 outputs of codes, tdpbssd, and
// with STORE the tile store) and/or the vector scaling of a stored 16 x 16 int32 tile into 16
// float32 sums (convert, multiply the scales, FMA), the two interleaved as the kernel runs them.
template <bool TILES, bool STORE, bool VECTOR>
__attribute__((target("amx-tile,amx-int8,avx512f"), noinline)) void int8_blocks(int64_t rounds, float* out) {
  TileConfig cfg;
  for (int t : {0, 1}) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  for (int t : {2, 4}) { cfg.rows[t] = 16; cfg.colsb[t] = 32; }
  for (int t : {3, 5}) { cfg.rows[t] = 8; cfg.colsb[t] = 64; }
  syscall(SYS_arch_prctl, 0x1023, 18);
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
  alignas(64) static thread_local int8_t a[512], b[512];
  alignas(64) static thread_local int32_t c[2][256], stored[256];
  alignas(64) static thread_local float xs[16];
  for (int i = 0; i < 512; ++i) a[i] = static_cast<int8_t>(i * 7), b[i] = static_cast<int8_t>(i % 16 - 8);
  for (int i = 0; i < 256; ++i) stored[i] = i - 128;
  for (int i = 0; i < 16; ++i) xs[i] = 0.001f * static_cast<float>(i);
  __m512 acc[16];
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
  const __m512 d = _mm512_set1_ps(0.5f);
  auto scale = [&]() __attribute__((always_inline)) {
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(stored + 16 * r)),
                               _mm512_mul_ps(d, _mm512_set1_ps(xs[r])), acc[r]);
    asm volatile("" : : : "memory");  // the stored tile is read again each block
  };
  for (int64_t i = 0; i < rounds; ++i) {
    if (TILES) {
      _tile_zero(0); _tile_loadd(2, a, 32); _tile_loadd(3, b, 64); _tile_dpbssd(0, 2, 3);
      if (STORE) _tile_stored(0, c[0], 64);
    }
    if (VECTOR) scale();
    if (TILES) {
      _tile_zero(1); _tile_loadd(4, a, 32); _tile_loadd(5, b, 64); _tile_dpbssd(1, 4, 5);
      if (STORE) _tile_stored(1, c[1], 64);
    }
    if (VECTOR) scale();
  }
  for (int r = 0; r < 16; ++r) _mm512_storeu_ps(out + 16 * r, acc[r]);
  _tile_release();
}

void int8_block_steps(int64_t mode, int64_t rounds) {
  alignas(64) float out[256];
  switch (mode) {
    case 0: return int8_blocks<true, true, false>(rounds, out);
    case 1: return int8_blocks<true, false, false>(rounds, out);
    case 2: return int8_blocks<false, false, true>(rounds, out);
    case 3: return int8_blocks<true, true, true>(rounds, out);
    default: return int8_blocks<true, false, true>(rounds, out);
  }
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("resident", &resident, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("blocked", &blocked, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("int8_block_steps", &int8_block_steps, pybind11::call_guard<pybind11::gil_scoped_release>());
}
"""


def _rate(run, flops: float, num_threads: int) -> float:
    """GFLOP/s of num_threads threads each running run() (flops each), best of 3."""
    best = float("inf")
    for _ in range(3):
        threads = [threading.Thread(target=run) for _ in range(num_threads)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        best = min(best, time.perf_counter() - start)
    return num_threads * flops / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,2")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from torch.utils.cpp_extension import load_inline

    if "amx_bf16" not in open("/proc/cpuinfo").read() or "amx_int8" not in open("/proc/cpuinfo").read():
        raise SystemExit("this CPU has no AMX-BF16 and AMX-INT8")
    ext = load_inline("minivllm_amx_peak", cpp_sources=_SOURCE, extra_cflags=["-O2", "-march=native", "-std=c++17"])
    gen = torch.Generator().manual_seed(0)
    tile_flops = 16 * 16 * 32 * 2  # one tile product: 16 x 16 outputs, 32 k, a multiply and an add
    operands = torch.randn(2048, generator=gen).bfloat16()
    rounds = 2_000_000
    cases = [("resident tiles (the unit's peak)", lambda: ext.resident(operands, rounds), rounds * 4 * tile_flops)]
    K, num_blocks = 576, 8
    for num_panels, note in [(24, "B 432 KB, in L2"), (192, "B 3.4 MB, past L2")]:
        A = torch.randn(num_blocks * 32 * K, generator=gen).bfloat16()
        B = torch.randn(num_panels * K * 16, generator=gen).bfloat16()
        flops = num_blocks * 32 * num_panels * 16 * K * 2
        reps = max(1, int(4e9 / flops))
        for label, store in [("sums to L1", False), ("sums stored to [256, N] float32", True)]:
            def run(A: torch.Tensor = A, B: torch.Tensor = B, n: int = num_panels, store: bool = store,
                    reps: int = reps) -> None:
                out = torch.empty(256, n * 16) if store else None  # each thread its own
                ext.blocked(A, B, K, num_blocks, n, out, reps)
            cases.append((f"2x2 kernel, K {K}, A 288 KB, {note}, {label}", run, reps * flops))
    for num_threads in (int(t) for t in args.threads.split(",")):
        for name, run, flops in cases:
            logger.info("%d thread(s): %-80s %7.0f GFLOP/s", num_threads, name, _rate(run, flops, num_threads))
    # A GGUF block on the int8 tiles (issue 63): nanoseconds a block, one thread.
    block_rounds = 500_000
    for mode, name in enumerate(["tile steps with the tile store", "tile steps without it", "vector scaling alone",
                                 "both, as the kernel interleaves them", "both, without the tile store"]):
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            ext.int8_block_steps(mode, block_rounds)
            best = min(best, time.perf_counter() - start)
        ns = best / (2 * block_rounds) * 1e9
        logger.info("1 thread: int8 GGUF block (16 x 16 x 32), %-40s %6.2f ns a block (%5.0f GOP/s)", name, ns,
                    16 * 16 * 32 * 2 / ns)


if __name__ == "__main__":
    main()
