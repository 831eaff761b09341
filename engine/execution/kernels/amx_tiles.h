// The AMX tile configuration shared by the products (packed_gemm.cpp) and the prefill attention
// (prefill_attention.cpp). x86-64 with GCC 11+ or clang only (MINIVLLM_HAS_AMX).
#pragma once

#if defined(__x86_64__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 11))
#define MINIVLLM_HAS_AMX 1
#endif

#if defined(MINIVLLM_HAS_AMX)
#include <immintrin.h>

#include <cstdint>

namespace minivllm {

// The tile registers' shapes, as ldtilecfg reads them (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// ldtilecfg of cfg. GCC 12 took the instruction for a reader of the configuration's first 32
// bytes and dropped the stores of its rows and column widths once the caller was not inlined (an
// invalid configuration: SIGSEGV at ldtilecfg, then SIGILL in the tiles): the barrier makes every
// store land first.
__attribute__((target("amx-tile"))) inline void load_tile_config(const TileConfig& cfg) {
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

}  // namespace minivllm
#endif  // MINIVLLM_HAS_AMX
