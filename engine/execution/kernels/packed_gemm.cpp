// Matrix products against weights packed for small batches (the decode step), for the CPU.
//
// At batch 1 a decode step is a chain of matrix-vector products whose cost is reading the
// weights once. The weights are packed in panels of 16 output channels, [ceil(N/16), K, 16]:
// a panel is one contiguous stream, each k gives one vector of 16 weights, and each row of x
// contributes one broadcast multiply-add into 16 outputs, so no horizontal sums are needed and
// any K works (no multiple of the vector width required). Weights are float32, bfloat16 or
// int8 with a scale per output channel (widened, scaled once at the end).
//
// bfloat16 panels interleave pairs of k, [ceil(N/16), Kp/2, 16, 2] with K padded to Kp, a
// multiple of 32: the layout AMX's bf16 tile product reads as its B operand, 16 pairs of k a
// tile row. The vector paths widen such a 64-byte row into k's 16 weights by a shift and k+1's
// by a mask (no shuffle).
//
// SIMD paths, chosen at run time by the caller (`isa`): AVX-512 (16 lanes, up to 8 rows per
// tile, 10 for int8), AVX2 + FMA (two 8-lane halves, up to 4 rows per tile), plain C++ elsewhere; these keep
// activations float32, only the weights are narrowed. Each tile keeps 8 independent
// accumulators (rows x unrolled k) so the multiply-adds do not wait on each other at batch 1.
// With AMX, bfloat16 products run on the tile unit instead: x rounded to bfloat16 (as torch's
// bf16 path rounds every activation), products summed in float32, up to 32 rows x 32 outputs a
// tile. On the model's layer shapes at 32 rows that runs several times the FMA path's rate
// (python -m bench.packed_gemm), so a batch-32 decode step no longer waits on the FMAs.
#include "amx_tiles.h"
#include "cpu_kernels.h"
#include "layer_parts.h"
#include "quant_tiles.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

// AMX intrinsics need GCC 11 or clang; an older compiler builds everything else.
#if defined(MINIVLLM_HAS_AMX)
#define MINIVLLM_HAS_AVX512_BF16 1  // vdpbf16ps (GCC 10+), built with the AMX code
#endif

namespace minivllm {
namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kRowBlock = 64;  // rows of x kept hot in cache while a task walks its panels
constexpr int64_t kAmxRowBlock = 256;  // the same on AMX, where a task's panels serve more rows
constexpr int64_t kTasksPerThread = 4;
// Weights are requested this far ahead of use: a layer's matrices are a few hundred KB each,
// too short a stream for the hardware prefetcher to reach full speed on its own. (The AMX
// tiles' distance; the vector paths' is prefetch_ahead.)
constexpr int64_t kPrefetchBytes = 4096;

constexpr int64_t kPairChunk = 32;  // bfloat16 panels pad K to this (one AMX tile's k)

// Weight j (< 16) of input k in a panel. float32 and int8 panels hold k's 16 weights at
// k * 16; bfloat16 panels hold the pair (k, k + 1), k even, interleaved at the same offset.
inline float weight_at(const float* w, int64_t k, int64_t j) { return w[k * kPanel + j]; }
inline float weight_at(const int8_t* w, int64_t k, int64_t j) { return static_cast<float>(w[k * kPanel + j]); }
inline float weight_at(const at::BFloat16* w, int64_t k, int64_t j) {
  return static_cast<float>(w[(k & ~int64_t{1}) * kPanel + 2 * j + (k & 1)]);
}

template <typename T>
void tile_scalar(const float* x, int64_t rows, int64_t ldx, const T* w, int64_t K, float* acc) {
  std::fill(acc, acc + rows * kPanel, 0.f);
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t m = 0; m < rows; ++m) {
      const float xv = x[m * ldx + k];
      for (int64_t j = 0; j < kPanel; ++j) acc[m * kPanel + j] += xv * weight_at(w, k, j);
    }
  }
}

#if defined(__x86_64__)
#define MINIVLLM_AVX512 __attribute__((target("avx512f,avx512bw,fma")))
#define MINIVLLM_AVX2 __attribute__((target("avx2,fma")))

// How far ahead (bytes of a panel) the vector paths request weights: 4 KB for float32 and 8 KB
// for the narrower bfloat16 and int8 panels, into L2 (prefetcht1), not L1: faster than 4 KB into
// L1 in every dtype and at every row count tried; 1 KB was slower, 16-32 KB no better. (The
// one-row vdpbf16ps tile requests nothing: see tile_dpbf16.)
template <typename T>
constexpr int64_t prefetch_ahead() {
  return sizeof(T) == 4 ? 4096 : 8192;
}

// Requests the cache lines of k and k + 1 (k even) of a panel, prefetch_ahead bytes on: two
// for float32, one for bfloat16, and for int8 one every other pair (k a multiple of 4).
template <typename T>
inline void prefetch_pair(const T* w, int64_t k) {
  const char* p = reinterpret_cast<const char*>(w + k * kPanel) + prefetch_ahead<T>();
  const int64_t offset = k * kPanel * static_cast<int64_t>(sizeof(T));
  if (offset % 64 != 0) return;  // int8: this pair shares the line the previous one requested
  for (int64_t line = 0; line < 2 * kPanel * static_cast<int64_t>(sizeof(T)); line += 64)
    _mm_prefetch(p + line, _MM_HINT_T1);
}

// The 16 weights of k and of k + 1 (k even).
MINIVLLM_AVX512 inline void load_pair(const float* w, int64_t k, __m512& even, __m512& odd) {
  even = _mm512_loadu_ps(w + k * kPanel);
  odd = _mm512_loadu_ps(w + (k + 1) * kPanel);
}
MINIVLLM_AVX512 inline __m512 widen16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
MINIVLLM_AVX512 inline void load_pair(const int8_t* w, int64_t k, __m512& even, __m512& odd) {
  even = widen16(w + k * kPanel);
  odd = widen16(w + (k + 1) * kPanel);
}
MINIVLLM_AVX512 inline void load_pair(const at::BFloat16* w, int64_t k, __m512& even, __m512& odd) {
  const __m512i pairs = _mm512_loadu_si512(w + k * kPanel);  // 16 x (k, k + 1)
  even = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
// The 16 weights of one k, either parity (the tail of an odd K).
MINIVLLM_AVX512 inline __m512 load_one(const float* w, int64_t k) { return _mm512_loadu_ps(w + k * kPanel); }
MINIVLLM_AVX512 inline __m512 load_one(const int8_t* w, int64_t k) { return widen16(w + k * kPanel); }
MINIVLLM_AVX512 inline __m512 load_one(const at::BFloat16* w, int64_t k) {
  __m512 even, odd;
  load_pair(w, k & ~int64_t{1}, even, odd);
  return (k & 1) ? odd : even;
}

// MT rows x 16 outputs; U (even) consecutive k run in separate accumulators, summed at the end.
template <int MT, int U, typename T>
MINIVLLM_AVX512 void tile_avx512(const float* x, int64_t ldx, const T* w, int64_t K, float* acc_out) {
  static_assert(U % 2 == 0, "k runs in pairs");
  __m512 acc[MT][U];
  for (int m = 0; m < MT; ++m)
    for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + U <= K; k += U) {
    for (int u = 0; u < U; u += 2) {
      prefetch_pair(w, k + u);
      __m512 even, odd;
      load_pair(w, k + u, even, odd);
      for (int m = 0; m < MT; ++m) {
        acc[m][u] = _mm512_fmadd_ps(even, _mm512_set1_ps(x[m * ldx + k + u]), acc[m][u]);
        acc[m][u + 1] = _mm512_fmadd_ps(odd, _mm512_set1_ps(x[m * ldx + k + u + 1]), acc[m][u + 1]);
      }
    }
  }
  for (; k < K; ++k) {
    const __m512 wv = load_one(w, k);
    for (int m = 0; m < MT; ++m) acc[m][0] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[m * ldx + k]), acc[m][0]);
  }
  for (int m = 0; m < MT; ++m) {
    __m512 sum = acc[m][0];
    for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, acc[m][u]);
    _mm512_storeu_ps(acc_out + m * kPanel, sum);
  }
}

// MT rows x 2 panels (32 outputs) at once, for compute-bound tiles (prefill rows, bigger
// batches): per k, 2 weight loads and MT broadcasts feed 2 * MT multiply-adds, where one panel
// gives MT + 1 loads for MT, so the loads rather than the FMA units set the pace.
template <int MT, typename T>
MINIVLLM_AVX512 void tile2_avx512(const float* x, int64_t ldx, const T* w0, const T* w1, int64_t K, float* acc_out) {
  __m512 acc0[MT], acc1[MT];
  for (int m = 0; m < MT; ++m) acc0[m] = acc1[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {
    prefetch_pair(w0, k);
    prefetch_pair(w1, k);
    __m512 a0, a1, b0, b1;
    load_pair(w0, k, a0, a1);
    load_pair(w1, k, b0, b1);
    for (int m = 0; m < MT; ++m) {
      const __m512 x0 = _mm512_set1_ps(x[m * ldx + k]), x1 = _mm512_set1_ps(x[m * ldx + k + 1]);
      acc0[m] = _mm512_fmadd_ps(a1, x1, _mm512_fmadd_ps(a0, x0, acc0[m]));
      acc1[m] = _mm512_fmadd_ps(b1, x1, _mm512_fmadd_ps(b0, x0, acc1[m]));
    }
  }
  if (k < K) {
    const __m512 a = load_one(w0, k), b = load_one(w1, k);
    for (int m = 0; m < MT; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * ldx + k]);
      acc0[m] = _mm512_fmadd_ps(a, xv, acc0[m]);
      acc1[m] = _mm512_fmadd_ps(b, xv, acc1[m]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    _mm512_storeu_ps(acc_out + m * kPanel, acc0[m]);
    _mm512_storeu_ps(acc_out + (MT + m) * kPanel, acc1[m]);
  }
}

// The 16 weights of one k as two 8-lane halves, for k and k + 1 (k even) or one k.
MINIVLLM_AVX2 inline void load8x2(const float* w, int64_t k, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(w + k * kPanel);
  hi = _mm256_loadu_ps(w + k * kPanel + 8);
}
MINIVLLM_AVX2 inline void load8x2(const int8_t* w, int64_t k, __m256& lo, __m256& hi) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * kPanel));
  lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
}
template <typename T>
MINIVLLM_AVX2 inline void load8x2_pair(const T* w, int64_t k, __m256& lo0, __m256& hi0, __m256& lo1, __m256& hi1) {
  load8x2(w, k, lo0, hi0);
  load8x2(w, k + 1, lo1, hi1);
}
MINIVLLM_AVX2 inline void load8x2_pair(const at::BFloat16* w, int64_t k, __m256& lo0, __m256& hi0, __m256& lo1,
                                       __m256& hi1) {
  const __m256i* p = reinterpret_cast<const __m256i*>(w + k * kPanel);
  const __m256i mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m256i lo = _mm256_loadu_si256(p), hi = _mm256_loadu_si256(p + 1);  // outputs 0-7, 8-15: (k, k + 1)
  lo0 = _mm256_castsi256_ps(_mm256_slli_epi32(lo, 16));
  hi0 = _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16));
  lo1 = _mm256_castsi256_ps(_mm256_and_si256(lo, mask));
  hi1 = _mm256_castsi256_ps(_mm256_and_si256(hi, mask));
}
MINIVLLM_AVX2 inline void load8x2(const at::BFloat16* w, int64_t k, __m256& lo, __m256& hi) {
  __m256 lo0, hi0, lo1, hi1;
  load8x2_pair(w, k & ~int64_t{1}, lo0, hi0, lo1, hi1);
  lo = (k & 1) ? lo1 : lo0;
  hi = (k & 1) ? hi1 : hi0;
}

// U consecutive k in separate accumulators (U even; U = 1: k and k + 1 share one).
template <int MT, int U, typename T>
MINIVLLM_AVX2 void tile_avx2(const float* x, int64_t ldx, const T* w, int64_t K, float* acc_out) {
  static_assert(U == 1 || U % 2 == 0, "k runs in pairs");
  constexpr int kStep = U == 1 ? 2 : U;
  __m256 lo[MT][U], hi[MT][U];
  for (int m = 0; m < MT; ++m)
    for (int u = 0; u < U; ++u) lo[m][u] = hi[m][u] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + kStep <= K; k += kStep) {
    for (int u = 0; u < kStep; u += 2) {
      prefetch_pair(w, k + u);
      constexpr int kOdd = U == 1 ? 0 : 1;
      __m256 wl0, wh0, wl1, wh1;
      load8x2_pair(w, k + u, wl0, wh0, wl1, wh1);
      for (int m = 0; m < MT; ++m) {
        const int a = U == 1 ? 0 : u;
        const __m256 x0 = _mm256_set1_ps(x[m * ldx + k + u]), x1 = _mm256_set1_ps(x[m * ldx + k + u + 1]);
        lo[m][a] = _mm256_fmadd_ps(wl0, x0, lo[m][a]);
        hi[m][a] = _mm256_fmadd_ps(wh0, x0, hi[m][a]);
        lo[m][a + kOdd] = _mm256_fmadd_ps(wl1, x1, lo[m][a + kOdd]);
        hi[m][a + kOdd] = _mm256_fmadd_ps(wh1, x1, hi[m][a + kOdd]);
      }
    }
  }
  for (; k < K; ++k) {
    __m256 wl, wh;
    load8x2(w, k, wl, wh);
    for (int m = 0; m < MT; ++m) {
      const __m256 xv = _mm256_set1_ps(x[m * ldx + k]);
      lo[m][0] = _mm256_fmadd_ps(wl, xv, lo[m][0]);
      hi[m][0] = _mm256_fmadd_ps(wh, xv, hi[m][0]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    __m256 sl = lo[m][0], sh = hi[m][0];
    for (int u = 1; u < U; ++u) {
      sl = _mm256_add_ps(sl, lo[m][u]);
      sh = _mm256_add_ps(sh, hi[m][u]);
    }
    _mm256_storeu_ps(acc_out + m * kPanel, sl);
    _mm256_storeu_ps(acc_out + m * kPanel + 8, sh);
  }
}
#endif  // __x86_64__

#if defined(MINIVLLM_HAS_AMX)
#define MINIVLLM_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,fma")))

// Tiles: C(r, p) = tmm(2r + p), the float32 sums of row block r (16 rows) and panel p; A(r) =
// tmm(4 + r), 16 rows x 32 k of x; B(p) = tmm(6 + p), panel p's 16 outputs x 32 k (16 pairs).
MINIVLLM_AMX void configure_tiles(int64_t rows0, int64_t rows1) {
  TileConfig cfg;
  for (int r = 0; r < 2; ++r) {
    const auto rows = static_cast<uint8_t>(r == 0 || rows1 == 0 ? rows0 : rows1);  // unused: any valid shape
    for (int t : {2 * r, 2 * r + 1, 4 + r}) {
      cfg.rows[t] = rows;
      cfg.colsb[t] = 64;
    }
  }
  for (int t : {6, 7}) {
    cfg.rows[t] = kPairChunk / 2;
    cfg.colsb[t] = 64;
  }
  load_tile_config(cfg);
}

// configure_tiles for a block of `rows` (<= 32) rows, only when the shape changed since the last
// block (a task's blocks are all 32 rows but its last).
class TileShape {
 public:
  MINIVLLM_AMX void fit(int64_t rows) {
    const int64_t rows0 = std::min<int64_t>(16, rows), rows1 = rows - rows0;
    if (rows0 == rows0_ && rows1 == rows1_) return;
    configure_tiles(rows0, rows1);
    rows0_ = rows0;
    rows1_ = rows1;
  }

 private:
  int64_t rows0_ = -1, rows1_ = -1;
};

// R row blocks (16 rows each; the last may be shorter, as configured) x P panels over the whole
// of Kp. xb: bfloat16 rows ldxb apart; w0, w1: panels. The sums go to c0 (panel 0) and c1
// (panel 1), float32 rows ldc floats apart, the second row block 16 rows down; with
// accumulate they start from what c0 and c1 hold (a residual added in the tile unit).
// prefetch: the panels come from memory (their first row block), so ask for them ahead.
// between(step): vector work run after each step's tile products are issued (gemm_amx_gated's),
// independent of this call's tiles, so the core runs it while the tile unit multiplies.
struct NoWork {
  void operator()(int64_t) const {}
};
template <int R, int P, typename Between = NoWork>
MINIVLLM_AMX void tile_amx(const uint16_t* xb, int64_t ldxb, const at::BFloat16* w0, const at::BFloat16* w1,
                           int64_t Kp, float* c0, float* c1, int64_t ldc, bool accumulate, bool prefetch,
                           Between&& between = Between{}) {
  const int64_t cstride = ldc * static_cast<int64_t>(sizeof(float));
  if (accumulate) {
    _tile_loadd(0, c0, cstride);
    if constexpr (P == 2) _tile_loadd(1, c1, cstride);
    if constexpr (R == 2) _tile_loadd(2, c0 + 16 * ldc, cstride);
    if constexpr (R == 2 && P == 2) _tile_loadd(3, c1 + 16 * ldc, cstride);
  } else {
    _tile_zero(0);
    if constexpr (P == 2) _tile_zero(1);
    if constexpr (R == 2) _tile_zero(2);
    if constexpr (R == 2 && P == 2) _tile_zero(3);
  }
  const int64_t stride = ldxb * static_cast<int64_t>(sizeof(uint16_t));
  for (int64_t k = 0; k < Kp; k += kPairChunk) {
    if (prefetch) {  // the panels' next tiles, kPrefetchBytes ahead
      const char* ahead0 = reinterpret_cast<const char*>(w0 + k * kPanel) + kPrefetchBytes;
      const char* ahead1 = reinterpret_cast<const char*>(w1 + k * kPanel) + kPrefetchBytes;
      for (int64_t line = 0; line < kPairChunk * kPanel * 2; line += 64) {
        _mm_prefetch(ahead0 + line, _MM_HINT_T0);
        if constexpr (P == 2) _mm_prefetch(ahead1 + line, _MM_HINT_T0);
      }
    }
    // x's rows with the streaming hint (TILELOADDT1): each is read once a block, and so leaves the
    // panels, which every block of the task reads again, in L1. qkv [2048, 384] x [384, 1152] went
    // from 1.07 to 0.93 ms (interleaved runs), down's [2048, 1536] x [1536, 384] was unchanged.
    _tile_stream_loadd(4, xb + k, stride);
    if constexpr (R == 2) _tile_stream_loadd(5, xb + 16 * ldxb + k, stride);
    _tile_loadd(6, w0 + k * kPanel, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (R == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (P == 2) {
      _tile_loadd(7, w1 + k * kPanel, 64);
      _tile_dpbf16ps(1, 4, 7);
      if constexpr (R == 2) _tile_dpbf16ps(3, 5, 7);
    }
    between(k / kPairChunk);
  }
  _tile_stored(0, c0, cstride);
  if constexpr (P == 2) _tile_stored(1, c1, cstride);
  if constexpr (R == 2) _tile_stored(2, c0 + 16 * ldc, cstride);
  if constexpr (R == 2 && P == 2) _tile_stored(3, c1 + 16 * ldc, cstride);
}

MINIVLLM_AMX void release_tiles() { _tile_release(); }
#endif  // MINIVLLM_HAS_AMX

#if defined(MINIVLLM_HAS_AVX512_BF16)
#define MINIVLLM_AVX512_ROUND __attribute__((target("avx512f,avx512bw")))
#define MINIVLLM_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16,fma")))

// 16 floats rounded to nearest-even bfloat16 (torch's rounding), as 16 bfloat16 bit patterns.
MINIVLLM_AVX512_ROUND inline __m256i round_bf16_512(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// xb[m, :Kp] = x[m, :K] rounded to nearest-even bfloat16 (round_bf16_512), zero past K.
MINIVLLM_AVX512_ROUND void round_rows_bf16(const float* x, int64_t M, int64_t ldx, int64_t K, uint16_t* xb, int64_t Kp) {
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < Kp; k += 16) {
      const int64_t left = std::max<int64_t>(0, std::min<int64_t>(16, K - k));
      const __mmask16 mask = static_cast<__mmask16>((1u << left) - 1u);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xb + m * Kp + k),
                          round_bf16_512(_mm512_maskz_loadu_ps(mask, x + m * ldx + k)));
    }
  }
}

// acc[MT rows, P panels x 16] = xb[MT, :Kp] . P bfloat16 panels by vdpbf16ps: one instruction
// multiplies a broadcast pair of x (k, k + 1) into a 64-byte panel row (16 outputs x that pair)
// and adds both products into 16 float32 sums, 32 multiply-adds where an FMA does 16. U
// independent accumulators per output (k pairs round-robin) keep the few-row tiles from
// waiting on the instruction's latency. acc_out: panel 0's MT rows, then panel 1's.
template <int MT, int P, int U>
MINIVLLM_AVX512_BF16 void tile_dpbf16(const uint16_t* xb, int64_t ldxb, const at::BFloat16* w0,
                                      const at::BFloat16* w1, int64_t Kp, float* acc_out) {
  __m512 acc[MT][P][U];
  for (int m = 0; m < MT; ++m)
    for (int p = 0; p < P; ++p)
      for (int u = 0; u < U; ++u) acc[m][p][u] = _mm512_setzero_ps();
  for (int64_t k = 0; k < Kp; k += 2 * U) {  // Kp: a multiple of 32, so of 2U
    for (int u = 0; u < U; ++u) {
      const int64_t kk = k + 2 * u;
      // One row reads its panel as one plain stream, which the hardware prefetcher follows
      // best alone here: without these requests the batch-1 products read faster, on 2 MiB
      // pages by far. The float32 tile's one-row loop was slower without them on 4 KiB pages
      // and even on 2 MiB ones, so it keeps them.
      if constexpr (MT > 1) prefetch_pair(w0, kk);
      if constexpr (P == 2) prefetch_pair(w1, kk);
      const __m512bh b0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w0 + kk * kPanel));
      __m512bh b1 = b0;
      if constexpr (P == 2) b1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w1 + kk * kPanel));
      for (int m = 0; m < MT; ++m) {
        int32_t pair;
        std::memcpy(&pair, xb + m * ldxb + kk, sizeof(pair));
        const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
        acc[m][0][u] = _mm512_dpbf16_ps(acc[m][0][u], a, b0);
        if constexpr (P == 2) acc[m][1][u] = _mm512_dpbf16_ps(acc[m][1][u], a, b1);
      }
    }
  }
  for (int p = 0; p < P; ++p)
    for (int m = 0; m < MT; ++m) {
      __m512 sum = acc[m][p][0];
      for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, acc[m][p][u]);
      _mm512_storeu_ps(acc_out + (p * MT + m) * kPanel, sum);
    }
}

// A tile of `rows` (<= 8) rows by one or two panels. Below kFewRows rows (memory bound) the two panels
// go one after the other, in memory order for the prefetcher, with more accumulators per output.
// One row keeps two: its loop is then one load, one broadcast and one vdpbf16ps per 64 bytes,
// twice unrolled, and the batch-1 bf16 decode read its weights faster than with eight, most
// while the two cores sat on two chiplets (four accumulators fell between). The float32 tile
// showed no such difference, so it keeps eight.
void run_tile_dpbf16(int64_t rows, bool pair, const uint16_t* xb, int64_t ldxb, const at::BFloat16* w0,
                     const at::BFloat16* w1, int64_t Kp, float* acc) {
  if (rows < kFewRows) {
    for (int p = 0; p < (pair ? 2 : 1); ++p) {
      const at::BFloat16* w = p == 0 ? w0 : w1;
      float* a = acc + p * rows * kPanel;
      switch (rows) {
        case 1: tile_dpbf16<1, 1, 2>(xb, ldxb, w, w, Kp, a); break;
        case 2: tile_dpbf16<2, 1, 4>(xb, ldxb, w, w, Kp, a); break;
        default: tile_dpbf16<3, 1, 4>(xb, ldxb, w, w, Kp, a); break;
      }
    }
    return;
  }
#define MINIVLLM_DP(MT)                                                                     \
  case MT:                                                                                  \
    return pair ? tile_dpbf16<MT, 2, 1>(xb, ldxb, w0, w1, Kp, acc) : tile_dpbf16<MT, 1, 2>(xb, ldxb, w0, w1, Kp, acc);
  switch (rows) {
    MINIVLLM_DP(4) MINIVLLM_DP(5) MINIVLLM_DP(6) MINIVLLM_DP(7)
    default: MINIVLLM_DP(8)
  }
#undef MINIVLLM_DP
}
#endif  // MINIVLLM_HAS_AVX512_BF16

// int8 panels take up to 10 rows a tile on AVX-512: their weights are widened to floats once
// per tile, which costs about what a row's multiply-adds do, so a 9-row step (a verification
// of 8 proposals) in one tile skips a second widening pass; float panels keep 8 (the loads,
// not the multiply-adds, set their pace past that).
constexpr int64_t kMaxTileRows = 10;

template <typename T>
int64_t max_tile_rows(int64_t isa) {
  if (isa < kIsaAvx512) return 4;
  return std::is_same_v<T, int8_t> ? kMaxTileRows : 8;
}

// acc[rows, 16] = x[rows, K] . panel, by the chosen path.
template <typename T>
void run_tile(int64_t isa, int64_t rows, const float* x, int64_t ldx, const T* w, int64_t K, float* acc) {
#if defined(__x86_64__)
  if (isa >= kIsaAvx512) {
    switch (rows) {
      case 1: return tile_avx512<1, 8>(x, ldx, w, K, acc);
      case 2: return tile_avx512<2, 4>(x, ldx, w, K, acc);
      case 3: return tile_avx512<3, 2>(x, ldx, w, K, acc);
      case 4: return tile_avx512<4, 2>(x, ldx, w, K, acc);
      case 5: return tile_avx512<5, 2>(x, ldx, w, K, acc);
      case 6: return tile_avx512<6, 2>(x, ldx, w, K, acc);
      case 7: return tile_avx512<7, 2>(x, ldx, w, K, acc);
      case 8: return tile_avx512<8, 2>(x, ldx, w, K, acc);
    }
    if constexpr (std::is_same_v<T, int8_t>) {  // only int8 tiles reach 9 or 10 rows (max_tile_rows)
      if (rows == 9) return tile_avx512<9, 2>(x, ldx, w, K, acc);
      return tile_avx512<10, 2>(x, ldx, w, K, acc);
    }
  }
  if (isa == kIsaAvx2) {
    switch (rows) {
      case 1: return tile_avx2<1, 4>(x, ldx, w, K, acc);
      case 2: return tile_avx2<2, 2>(x, ldx, w, K, acc);
      case 3: return tile_avx2<3, 1>(x, ldx, w, K, acc);
      default: return tile_avx2<4, 1>(x, ldx, w, K, acc);
    }
  }
#endif
  tile_scalar(x, rows, ldx, w, K, acc);
}

// acc[2 * rows, 16] = x[rows, K] . (panel w0, then panel w1); false when the ISA has no such tile.
template <typename T>
bool run_tile2(int64_t isa, int64_t rows, const float* x, int64_t ldx, const T* w0, const T* w1, int64_t K,
               float* acc) {
#if defined(__x86_64__)
  // Not for int8: two panels a tile widen twice the weights per k for the same multiply-adds
  // per row, and the widening shares the multiply-adds' units.
  if constexpr (std::is_same_v<T, int8_t>) return false;
  if (isa >= kIsaAvx512) {
    switch (rows) {
      case 4: tile2_avx512<4>(x, ldx, w0, w1, K, acc); return true;
      case 5: tile2_avx512<5>(x, ldx, w0, w1, K, acc); return true;
      case 6: tile2_avx512<6>(x, ldx, w0, w1, K, acc); return true;
      case 7: tile2_avx512<7>(x, ldx, w0, w1, K, acc); return true;
      case 8: tile2_avx512<8>(x, ldx, w0, w1, K, acc); return true;
      default: return false;
    }
  }
#endif
  return false;
}

// out rows [m0, m0 + rows), columns [n0, n0 + width) from acc[rows, 16]. The options are
// tested once per tile, not per element, so each loop below is one vectorised pass.
inline void store_tile(const float* acc, int64_t rows, int64_t m0, int64_t n0, int64_t width, const float* scale,
                       const float* bias, float* out, int64_t ldo, bool accumulate) {
  alignas(64) float scaled[8 * 2 * kPanel];
  if (scale != nullptr || bias != nullptr) {
    const int64_t max_rows = static_cast<int64_t>(sizeof(scaled) / sizeof(float)) / kPanel;
    for (int64_t r0 = 0; r0 < rows; r0 += max_rows) {
      const int64_t count = std::min(max_rows, rows - r0);
      for (int64_t r = 0; r < count; ++r) {
        const float* a = acc + (r0 + r) * kPanel;
        float* d = scaled + r * kPanel;
#pragma omp simd
        for (int64_t j = 0; j < width; ++j)  // bias holds N values, not a padded panel's
          d[j] = a[j] * (scale != nullptr ? scale[n0 + j] : 1.f) + (bias != nullptr ? bias[n0 + j] : 0.f);
      }
      store_tile(scaled, count, m0 + r0, n0, width, nullptr, nullptr, out, ldo, accumulate);
    }
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + (m0 + r) * ldo + n0;
    const float* a = acc + r * kPanel;
    if (accumulate) {
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) o[j] += a[j];
    } else {
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) o[j] = a[j];
    }
  }
}

// The panels of each task of a product (the same split for every row block). Fewer, longer
// tasks were tried for a team's batch-1 products (each task costs atomic operations on lines the
// members share, slow across chiplets): no gain beyond noise, and one task a member would leave
// a preempted member's home unshared, so four it stays.
int64_t panels_per_task(int64_t num_panels, int64_t num_threads) {
  return std::max<int64_t>(1, (num_panels + kTasksPerThread * num_threads - 1) / (kTasksPerThread * num_threads));
}

// A team's few-row product split into homes (rank r's: panels [r P / R, (r + 1) P / R)), each in
// tasks that shrink towards its back: quarters of the home while more than half of it is left,
// then halves of what is left, down to one panel (96 panels: 24 24 24 12 6 3 2 1). A member
// takes its own home from the front and steals from the back of another's, so the member that
// runs out first finds small tasks to take, and the part ends with both at work. With four even
// tasks a member (the split before), the first to finish waited for the other's last task, on
// average half a task, while the members' own tasks read near a plain sum's rate. Only below
// kFewRows rows: a task's panels are then each computed alone, so the split does not change a
// float (paired panels at more rows would).
struct TaperedSplit {
  int64_t num_panels, num_ranks, tasks_per_home;

  TaperedSplit(int64_t num_panels, int64_t num_ranks)
      : num_panels(num_panels), num_ranks(num_ranks), tasks_per_home(0) {
    for (int64_t r = 0; r < num_ranks; ++r) {
      const int64_t home = home_begin(num_panels, num_ranks, r + 1) - home_begin(num_panels, num_ranks, r);
      int64_t tasks = 0;
      for (int64_t begin = 0; begin < home; ++tasks) begin += step(home, begin);
      tasks_per_home = std::max(tasks_per_home, tasks);
    }
  }
  int64_t num_tasks() const { return num_ranks * tasks_per_home; }
  // The first panel of rank's home (no split needed: prefetch_team_home asks for it per product).
  static int64_t home_begin(int64_t num_panels, int64_t num_ranks, int64_t rank) {
    return rank * num_panels / num_ranks;
  }
  // [begin, end) of task `task`: rank task / tasks_per_home's home, empty past its last task.
  std::pair<int64_t, int64_t> panels(int64_t task) const {
    const int64_t rank = task / tasks_per_home, first = home_begin(num_panels, num_ranks, rank);
    const int64_t home = home_begin(num_panels, num_ranks, rank + 1) - first;
    int64_t begin = 0;
    for (int64_t j = 0; j < task % tasks_per_home && begin < home; ++j) begin += step(home, begin);
    return {first + begin, first + (begin < home ? begin + step(home, begin) : home)};
  }

 private:
  static int64_t step(int64_t home, int64_t begin) {
    const int64_t left = home - begin;
    return left > home / 2 ? std::min(left, (home + 3) / 4) : (left + 1) / 2;
  }
};

// Runs body(m_begin, m_end, panel_begin, panel_end) over row blocks of row_block rows x runs of
// chunk panels (parallel_tasks says how).
template <typename Body>
void parallel_blocks(int64_t M, int64_t num_panels, int64_t row_block, int64_t chunk, const TeamShare* team,
                     const Body& body) {
  const int64_t num_threads = num_workers(team);
  const int64_t num_chunks = (num_panels + chunk - 1) / chunk;
  const int64_t num_tasks = num_chunks * ((M + row_block - 1) / row_block);
  const auto run = [&](int64_t task) {
    const int64_t m_block = (task / num_chunks) * row_block, begin = (task % num_chunks) * chunk;
    body(m_block, std::min(M, m_block + row_block), begin, std::min(num_panels, begin + chunk));
  };
  if (team != nullptr) return team->for_each_task(num_tasks, run);
  // Threads forked here, for this product alone, take a team's home ranges (TeamShare): the
  // tasks numbered chunk by chunk, so rank r's home is a run of whole chunks' row blocks, and the
  // weights it multiplies stay in its own core's caches from one row block to the next (from one
  // shared queue in row-block order, each thread's next task was often another's chunk: every
  // core read all the weights). The tasks are the same, so who runs one changes no float.
  const int64_t num_row_blocks = (M + row_block - 1) / row_block;
  std::atomic<int64_t> next_task{0};
  const std::unique_ptr<HomeRange[]> homes(new HomeRange[num_threads]);
  const TeamShare forked{num_threads, &next_task, nullptr, nullptr, 0, homes.get()};
  at::parallel_for(0, num_threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t rank = begin; rank < end; ++rank) {
      TeamShare share = forked;
      share.rank = rank;
      share.for_each_task(num_tasks, [&](int64_t t) { run((t % num_row_blocks) * num_chunks + t / num_row_blocks); });
    }
  });
}

// Runs body(m_begin, m_end, panel_begin, panel_end) over tasks of a few panels each (for one
// block of rows), taken from a shared counter rather than split evenly up front: a thread the OS
// preempts (a serving process's event loop, a client on the same cores) then delays its own
// tasks only, not the whole product. With a team (a parallel region already running, as
// DecodeModel's step), this thread takes its share of the tasks without a fork or a join;
// tapered (below kFewRows rows, where the split cannot change a float), in TaperedSplit's tasks.
template <typename Body>
void parallel_tasks(int64_t M, int64_t num_panels, int64_t row_block, const TeamShare* team, bool tapered,
                    const Body& body) {
  if (team != nullptr && tapered && M < kFewRows) {
    const TaperedSplit split(num_panels, team->num_ranks);
    return team->for_each_task(split.num_tasks(), [&](int64_t task) {
      const auto [begin, end] = split.panels(task);
      if (begin < end) body(0, M, begin, end);
    });
  }
  parallel_blocks(M, num_panels, row_block, panels_per_task(num_panels, num_workers(team)), team, body);
}

// A product's tasks on the AMX tiles: row blocks x runs of panels. Split the rows first and give
// each task as many panels as keep its weights within kAmxTaskWeightBytes (in the core's L2
// beside the task's rows; panel_bytes: one panel's, or one gate/up pair's), pairs only (a lone
// panel runs as a pair's half). At 2,048 rows a product of 24 panels split into tasks of 3 panels
// read its 256-row blocks of x from L3 once per 3 panels: 1.5 TFLOP/s against 2.5 with all 24
// panels a task (a scratch copy of the tile loop, bge-small's [2048, 384] x [384, 384]).
struct AmxSplit {
  int64_t row_block, chunk;
};
constexpr int64_t kAmxTaskWeightBytes = int64_t{5} << 18;  // 1.25 MiB of a 2 MiB L2
AmxSplit amx_split(int64_t M, int64_t num_panels, int64_t panel_bytes, int64_t num_threads) {
  const auto even = [](int64_t n) { return std::max<int64_t>(2, (n + 1) / 2 * 2); };
  const auto blocks_of = [](int64_t n, int64_t size) { return (n + size - 1) / size; };
  const int64_t num_tasks = kTasksPerThread * num_threads;
  const int64_t max_chunk = std::max<int64_t>(2, kAmxTaskWeightBytes / std::max<int64_t>(1, panel_bytes) / 2 * 2);
  int64_t num_chunks = blocks_of(num_panels, max_chunk);
  const int64_t max_row_blocks = blocks_of(M, 32);
  // Too few rows for the tasks: the panels are split further (down to one pair a task).
  if (num_chunks * max_row_blocks < num_tasks) num_chunks = std::max(num_chunks, blocks_of(num_tasks, max_row_blocks));
  const int64_t chunk = std::min(even(blocks_of(num_panels, num_chunks)), even(num_panels));
  num_chunks = blocks_of(num_panels, chunk);
  // Row blocks of a multiple of 32 rows, at most kAmxRowBlock, for about num_tasks tasks in all,
  // and a whole number of tasks a thread where the rows allow (9 tasks on 2 threads left one
  // thread a task behind). The count is the rounded blocks', not the asked-for one.
  const auto row_block_of = [&](int64_t n) {
    return std::min(kAmxRowBlock, std::max<int64_t>(32, blocks_of(blocks_of(M, n), 32) * 32));
  };
  const int64_t first_try = blocks_of(num_tasks, num_chunks);
  for (int64_t n = first_try; n <= max_row_blocks; ++n) {
    const int64_t row_block = row_block_of(n);
    if (num_chunks * blocks_of(M, row_block) % num_threads == 0) return {row_block, chunk};
  }
  return {row_block_of(first_try), chunk};
}

// Kp: the panels' padded K. Past kAmxMaxSplitK a 256-row block of x is itself most of an L2 (1 MiB
// at 2,048): those products keep parallel_tasks' split, which was not measured against this one.
constexpr int64_t kAmxMaxSplitK = 1536;
template <typename Body>
void parallel_amx_tasks(int64_t M, int64_t num_panels, int64_t Kp, int64_t panel_bytes, const TeamShare* team,
                        const Body& body) {
  if (M <= 0 || num_panels <= 0) return;  // nothing to multiply (amx_split would divide by zero)
  if (Kp > kAmxMaxSplitK) return parallel_tasks(M, num_panels, kAmxRowBlock, team, false, body);
  const AmxSplit split = amx_split(M, num_panels, panel_bytes, num_workers(team));
  parallel_blocks(M, num_panels, split.row_block, split.chunk, team, body);
}

#if defined(__x86_64__)
// One row of 16 outputs from acc to o (64-byte aligned) past the caches (a non-temporal store).
__attribute__((target("avx512f"))) inline void stream_panel_row(float* o, const float* acc) {
  _mm512_stream_ps(o, _mm512_loadu_ps(acc));
}
#endif

// The panels' product tile by tile, for the vector paths: tasks of a few panels (two a tile
// where it can) against row tiles of up to tile_rows rows. tile(rows, m0, p, pair, acc) fills
// acc with rows x 16 outputs of panel p, then, when pair, those of panel p + 1 after them.
//
// stream_rows (AVX-512, a team's one-row products that overwrite out): each panel's 16 outputs
// go to memory past the caches. The team's other member reads them next, and on two chiplets
// a plain store first had to take back the line that member read the step before, which slowed
// the batch-1 bf16 gate/up product there. Non-temporal stores are weakly ordered, so each task
// ends with a store fence before the team counts it done.
//
// out_act (an OutputActivation): applied to each tile's outputs once they are stored, while they
// are in L1, instead of in a pass of its own over the whole output (an encoder's up projection:
// bias + GELU).
template <typename Tile>
void gemm_tiles(int64_t M, int64_t N, int64_t tile_rows, const float* scale, const float* bias, float* out,
                int64_t ldo, bool accumulate, const TeamShare* team, bool stream_rows, const Tile& tile,
                int64_t out_act = kOutNone, int64_t isa = kIsaScalar) {
  const bool stream = stream_rows && M == 1 && !accumulate && scale == nullptr && bias == nullptr &&
                      out_act == kOutNone && reinterpret_cast<uintptr_t>(out) % 64 == 0;
  parallel_tasks(M, (N + kPanel - 1) / kPanel, kRowBlock, team, true, [&](int64_t m_block, int64_t m_end,
                                                                           int64_t begin, int64_t end) {
    alignas(64) float acc[2 * kMaxTileRows * kPanel];
    for (int64_t p = begin; p < end;) {
      const int64_t n0 = p * kPanel, width = std::min(kPanel, N - n0);
      const bool pair = p + 1 < end;
      const int64_t width1 = pair ? std::min(kPanel, N - n0 - kPanel) : 0;
      for (int64_t m0 = m_block; m0 < m_end; m0 += tile_rows) {
        const int64_t rows = std::min(tile_rows, m_end - m0);
        tile(rows, m0, p, pair, acc);
#if defined(__x86_64__)
        if (stream && width == kPanel && (!pair || width1 == kPanel)) {
          stream_panel_row(out + n0, acc);
          if (pair) stream_panel_row(out + n0 + kPanel, acc + kPanel);
          continue;
        }
#endif
        store_tile(acc, rows, m0, n0, width, scale, bias, out, ldo, accumulate);
        if (pair) store_tile(acc + rows * kPanel, rows, m0, n0 + kPanel, width1, scale, bias, out, ldo, accumulate);
        if (out_act != kOutNone) {
          for (int64_t r = 0; r < rows; ++r) activate(out + (m0 + r) * ldo + n0, width + width1, out_act, isa);
        }
      }
      p += pair ? 2 : 1;
    }
#if defined(__x86_64__)
    if (stream) _mm_sfence();
#endif
  });
}

// The product on the vector units: x stays float32.
template <typename T>
void gemm_vector(const float* x, int64_t M, int64_t ldx, const T* w, int64_t panel_size, int64_t K, const float* scale,
                 const float* bias, int64_t N, float* out, int64_t ldo, int64_t isa, bool accumulate,
                 const TeamShare* team, int64_t out_act = kOutNone) {
  gemm_tiles(M, N, max_tile_rows<T>(isa), scale, bias, out, ldo, accumulate, team, team != nullptr && isa >= kIsaAvx512,
             [&](int64_t rows, int64_t m0, int64_t p, bool pair, float* acc) {
               const T* panel = w + p * panel_size;
               // Two panels a tile where the tile is compute bound (several rows); else one at a
               // time, in memory order for the prefetcher.
               if (pair && run_tile2(isa, rows, x + m0 * ldx, ldx, panel, panel + panel_size, K, acc)) return;
               run_tile(isa, rows, x + m0 * ldx, ldx, panel, K, acc);
               if (pair) run_tile(isa, rows, x + m0 * ldx, ldx, panel + panel_size, K, acc + rows * kPanel);
             }, out_act, isa);
}

#if defined(MINIVLLM_HAS_AVX512_BF16)
// x [M, K] rounded to bfloat16 rows of Kp (the bf16-product paths' left operand), zero past K.
Scratch<uint16_t> rounded_rows(const float* x, int64_t M, int64_t ldx, int64_t K, int64_t Kp) {
  Scratch<uint16_t> xb = scratch_array<uint16_t>(M * Kp);  // every element written below: not zeroed first
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    round_rows_bf16(x + begin * ldx, end - begin, ldx, K, xb.get() + begin * Kp, Kp);
  });
  return xb;
}

}  // namespace

Scratch<uint16_t> round_rows_to_bf16(const float* x, int64_t M, int64_t ldx, int64_t K) {
  return rounded_rows(x, M, ldx, K, (K + 15) / 16 * 16);
}

void round_rows_into_bf16(const float* x, int64_t M, int64_t ldx, int64_t K, uint16_t* out) {
  TORCH_CHECK(K % 16 == 0, "round_rows_into_bf16: K must be a multiple of 16");
  round_rows_bf16(x, M, ldx, K, out, K);
}

namespace {

// The product by vdpbf16ps, for bfloat16 panels on AVX-512 CPUs with BF16 but no AMX (AMD Zen 4
// and later, Intel Cooper Lake): x rounded to bfloat16 once (as the AMX path rounds it, so a
// row's result does not depend on the batch), products summed in float32.
void gemm_dpbf16(const float* x, int64_t M, int64_t ldx, const at::BFloat16* w, int64_t Kp, int64_t K,
                 const float* bias, int64_t N, float* out, int64_t ldo, bool accumulate, const TeamShare* team,
                 int64_t out_act = kOutNone) {
  const auto xb = rounded_rows(x, M, ldx, K, Kp);
  const int64_t panel_size = Kp * kPanel;
  const auto tile = [&](int64_t rows, int64_t m0, int64_t p, bool pair, float* acc) {
    const at::BFloat16* panel = w + p * panel_size;
    run_tile_dpbf16(rows, pair, xb.get() + m0 * Kp, Kp, panel, panel + panel_size, Kp, acc);
  };
  gemm_tiles(M, N, 8, nullptr, bias, out, ldo, accumulate, team, team != nullptr, tile, out_act, kIsaAvx512Bf16);
}
#endif

#if defined(MINIVLLM_HAS_AMX)
// A finished block's rows, pending: tile_amx's `between` for the next block, which finishes about
// num_rows / num_steps of them after each of its tile steps, so the vector work on them runs
// while the tile unit multiplies (a block's epilogue run after the block left the tile unit
// waiting). Row is the epilogue: row(r) finishes the block's row r.
template <typename Row>
struct PendingRows {
  Row row;
  int64_t num_rows = 0, num_done = 0, rows_per_step = 0;

  void start(const Row& block_row, int64_t rows, int64_t num_steps) {
    row = block_row;
    num_rows = rows;
    num_done = 0;
    rows_per_step = (rows + num_steps - 1) / num_steps;
  }
  MINIVLLM_AMX void operator()(int64_t step) { finish_upto((step + 1) * rows_per_step); }
  MINIVLLM_AMX void finish_upto(int64_t upto) {
    for (upto = std::min(upto, num_rows); num_done < upto; ++num_done) row(num_done);
  }
  MINIVLLM_AMX void finish() { finish_upto(num_rows); }
};

// A biased block's row: store_tile's operations on it (the bias added, then added to what out
// holds when accumulating: a residual), so the bits are store_tile's; pending, the pass over
// out's rows (the residual's read and write) overlaps the next block's tile steps.
struct BiasRow {
  const float* sums = nullptr;  // panel 0 [32 rows][16], then panel 1 [32 rows][16]
  const float* bias = nullptr;  // the block's first output's
  float* out = nullptr;         // the block's first row of outputs, rows ldo apart
  int64_t ldo = 0, num_panels = 0;
  bool accumulate = false;
  MINIVLLM_AMX void operator()(int64_t r) const {
    for (int64_t j = 0; j < num_panels; ++j) {
      float* o = out + r * ldo + j * kPanel;
      __m512 v = _mm512_add_ps(_mm512_load_ps(sums + (32 * j + r) * kPanel), _mm512_loadu_ps(bias + j * kPanel));
      if (accumulate) v = _mm512_add_ps(_mm512_loadu_ps(o), v);
      _mm512_storeu_ps(o, v);
    }
  }
};

// tile_amx for a block of `rows` (<= 32, as configured) rows and one panel, w0, or a pair.
template <typename Between = NoWork>
MINIVLLM_AMX void tile_amx_block(int64_t rows, bool pair, const uint16_t* xm, int64_t Kp, const at::BFloat16* w0,
                                 const at::BFloat16* w1, float* c0, float* c1, int64_t ldc, bool accumulate,
                                 bool prefetch, Between&& between = Between{}) {
  if (rows > 16) {
    pair ? tile_amx<2, 2>(xm, Kp, w0, w1, Kp, c0, c1, ldc, accumulate, prefetch, between)
         : tile_amx<2, 1>(xm, Kp, w0, w0, Kp, c0, c1, ldc, accumulate, prefetch, between);
  } else {
    pair ? tile_amx<1, 2>(xm, Kp, w0, w1, Kp, c0, c1, ldc, accumulate, prefetch, between)
         : tile_amx<1, 1>(xm, Kp, w0, w0, Kp, c0, c1, ldc, accumulate, prefetch, between);
  }
}

// The product on the AMX tiles, for bfloat16 panels (Kp = their padded K). Full panels without
// a bias go straight between the tiles and `out`; with a bias, through acc and BiasRow rows pending;
// a partial panel through acc and store_tile. xb: x already rounded to bfloat16, [M, Kp] (zero
// past K).
void gemm_amx_rounded(const uint16_t* xb, int64_t M, const at::BFloat16* w, int64_t Kp, const float* bias, int64_t N,
                      float* out, int64_t ldo, bool accumulate, const TeamShare* team) {
  const int64_t panel_size = Kp * kPanel;
  const int64_t num_steps = std::max<int64_t>(1, Kp / kPairChunk);
  // Per task a pair of panels at a time (the pair's weights, 2 x Kp x 32 bytes, stay in L1/L2)
  // against every 32-row block of up to kAmxRowBlock rows of x.
  // Not tapered (TaperedSplit): that a tapered split's pairing leaves the tiles' floats as they
  // are has not been checked on AMX.
  const auto run = [&](int64_t m_block, int64_t m_end, int64_t begin, int64_t end) {
    alignas(64) float acc[2][4 * 16 * kPanel];  // [panel][32 rows][16], two blocks' (one pending)
    PendingRows<BiasRow> pending;
    TileShape shape;
    int cur = 0;
    for (int64_t p = begin; p < end; p += 2) {
      const at::BFloat16* panel = w + p * panel_size;
      const bool pair = p + 1 < end;
      const int64_t n0 = p * kPanel, width = (pair ? 2 : 1) * kPanel;
      const bool is_full = n0 + width <= N, direct = bias == nullptr && is_full;
      for (int64_t m0 = m_block; m0 < m_end; m0 += 32) {
        const int64_t rows = std::min<int64_t>(32, m_end - m0);
        shape.fit(rows);
        const uint16_t* xm = xb + m0 * Kp;
        float* c0 = direct ? out + m0 * ldo + n0 : acc[cur];
        float* c1 = direct ? c0 + kPanel : acc[cur] + 32 * kPanel;
        const int64_t ldc = direct ? ldo : kPanel;
        const bool load_c = direct && accumulate;
        const bool first = m0 == m_block;
        tile_amx_block(rows, pair, xm, Kp, panel, panel + panel_size, c0, c1, ldc, load_c, first, pending);
        if (direct) continue;
        pending.finish();
        if (is_full) {  // with a bias: its rows run between the next block's tile steps
          pending.start(BiasRow{c0, bias + n0, out + m0 * ldo + n0, ldo, pair ? 2 : 1, accumulate}, rows, num_steps);
          cur ^= 1;
          continue;
        }
        store_tile(c0, rows, m0, n0, std::min(kPanel, N - n0), nullptr, bias, out, ldo, accumulate);
        if (pair)
          store_tile(c1, rows, m0, n0 + kPanel, std::min(kPanel, N - n0 - kPanel), nullptr, bias, out, ldo,
                     accumulate);
      }
    }
    pending.finish();
    release_tiles();
  };
  parallel_amx_tasks(M, (N + kPanel - 1) / kPanel, Kp, panel_size * 2, team, run);
}

void gemm_amx(const float* x, int64_t M, int64_t ldx, const at::BFloat16* w, int64_t Kp, int64_t K,
              const float* bias, int64_t N, float* out, int64_t ldo, bool accumulate, const TeamShare* team) {
  const auto xb = rounded_rows(x, M, ldx, K, Kp);  // [M, Kp]
  gemm_amx_rounded(xb.get(), M, w, Kp, bias, N, out, ldo, accumulate, team);
}

// x [M, K] RMS-normed row by row (rms_norm_row, the fused layers' norm) and rounded to bfloat16
// rows of Kp, zero past K: the product's left operand in one pass, the same values as the norm's
// float32 output rounded after it.
Scratch<uint16_t> normed_rounded_rows(const float* x, int64_t M, int64_t ldx, int64_t K, const float* weight, float eps,
                                      int64_t Kp) {
  Scratch<uint16_t> xb = scratch_array<uint16_t>(M * Kp);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(K);
    for (int64_t m = begin; m < end; ++m) {
      rms_norm_row(x + m * ldx, K, weight, eps, row.data());
      round_rows_bf16(row.data(), 1, K, K, xb.get() + m * Kp, Kp);
    }
  });
  return xb;
}

// A gated block's row (pending: PendingRows): silu_mul512 and round_bf16_512 inlined into the
// tile loop, the operations of silu_mul and round_rows_bf16 (so the same bits): through those
// calls (three a row) the overlap saved nothing.
struct SiluRow {
  const float* sums = nullptr;  // gate [32 rows][16], then up [32 rows][16]
  uint16_t* out = nullptr;      // the block's first row of 16 in ab, rows ldo apart
  int64_t ldo = 0;
  MINIVLLM_AMX void operator()(int64_t r) const {
    const __m512 g = _mm512_load_ps(sums + r * kPanel), u = _mm512_load_ps(sums + (32 + r) * kPanel);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo), round_bf16_512(silu_mul512(g, u)));
  }
};

// A gated MLP's gate/up product on the tiles with the activation in its epilogue: gate panel p
// and the up panel of the same 16 outputs (p + I / 16) are one tile pair, and act(g) * u goes
// from the pair's float32 sums (in L1) straight to ab [M, Ip] in bfloat16, the down product's
// left operand (zero past I). The float32 [M, 2 I] product and the activation's [M, I] were
// written and read back through L3 at prefill sizes (6 MB and 3 MB a 512-row chunk of the
// default model), and rounded in a pass of their own; the floats are the same (the same
// activation code on the same sums, the same rounding).
//
// SiLU's rows run a few at a time between the tile steps of the next block (PendingRows<SiluRow>), not
// after their own block, where the tile unit waited for them: a scratch copy of the loop
// ([512, 576] x [576, 2 x 1536], one thread) took 1,125 us for the tiles alone, 1,431 with the
// activation after each block, 1,265 with it between the next block's steps. Other activations
// (Gemma's GELU) still run after their block.
void gemm_amx_gated(const uint16_t* xb, int64_t M, const at::BFloat16* w, int64_t Kp, int64_t I, int64_t act,
                    uint16_t* ab, int64_t Ip) {
  const int64_t panel_size = Kp * kPanel, num_gate_panels = I / kPanel;
  const int64_t num_steps = std::max<int64_t>(1, Kp / kPairChunk);
  const auto run = [&](int64_t m_block, int64_t m_end, int64_t begin, int64_t end) {
    // Two blocks' sums, each gate [32 rows][16] then up [32 rows][16]: the one on the tiles and
    // the one whose rows are pending.
    alignas(64) float acc[2][4 * 16 * kPanel];
    alignas(64) float a[2 * 16 * kPanel];
    PendingRows<SiluRow> pending;
    TileShape shape;
    int cur = 0;
    for (int64_t p = begin; p < end; ++p) {
      const at::BFloat16* gate = w + p * panel_size;
      const at::BFloat16* up = w + (p + num_gate_panels) * panel_size;
      for (int64_t m0 = m_block; m0 < m_end; m0 += 32) {
        const int64_t rows = std::min<int64_t>(32, m_end - m0);
        shape.fit(rows);
        const bool first = m0 == m_block;
        float* sums = acc[cur];
        float* c1 = sums + 32 * kPanel;
        if (act == kActSilu) {
          tile_amx_block(rows, true, xb + m0 * Kp, Kp, gate, up, sums, c1, kPanel, false, first, pending);
          pending.finish();
          pending.start(SiluRow{sums, ab + m0 * Ip + p * kPanel, Ip}, rows, num_steps);
          cur ^= 1;
          continue;
        }
        tile_amx_block(rows, true, xb + m0 * Kp, Kp, gate, up, sums, c1, kPanel, false, first);
        gated_act(sums, c1, a, rows * kPanel, act, kIsaAvx512);
        for (int64_t r = 0; r < rows; ++r)  // one row of 16: its own Kp, so nothing is padded
          round_rows_bf16(a + r * kPanel, 1, kPanel, kPanel, ab + (m0 + r) * Ip + p * kPanel, kPanel);
      }
    }
    pending.finish();
    release_tiles();
  };
  parallel_amx_tasks(M, num_gate_panels, Kp, 2 * panel_size * 2, nullptr, run);
  if (Ip > I) {
    for (int64_t m = 0; m < M; ++m) std::fill(ab + m * Ip + I, ab + (m + 1) * Ip, uint16_t{0});
  }
}

// A block's row of bfloat16 outputs (pending: PendingRows): the operations store_tile, activate
// and round_rows_bf16 ran on it one pass after another (the bias added, gelu_erf512 or
// gelu_tanh512 unless act is kOutNone, round_bf16_512), so the bits are theirs.
struct Bf16Row {
  const float* sums = nullptr;  // panel 0 [32 rows][16], then panel 1 [32 rows][16]
  const float* bias = nullptr;  // the block's first output's, or null
  uint16_t* out = nullptr;      // the block's first row of outputs, rows ldo apart
  int64_t ldo = 0, num_panels = 0, act = kOutNone;
  MINIVLLM_AMX void operator()(int64_t r) const {
    for (int64_t j = 0; j < num_panels; ++j) {
      __m512 v = _mm512_load_ps(sums + (32 * j + r) * kPanel);
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + j * kPanel));
      if (act == kOutGelu) v = gelu_erf512(v);
      if (act == kOutGeluTanh) v = gelu_tanh512(v);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + j * kPanel), round_bf16_512(v));
    }
  }
};

// A product on the tiles with bias (+ GELU: act kOutGelu or kOutGeluTanh; kOutNone: none) in its
// epilogue, out [M, N] bfloat16 (N a multiple of 32): an encoder's up projection, the down
// product's left operand as it is, or its fused QKV, which its attention reads in bfloat16.
// Through gemm_amx the float32 [M, N] product went out to memory and was read back twice (a GELU
// or attention's rounding pass, then the down product's rounding pass): 3 MB a 512-row step of
// bge-small's up projection. Each block's rows run between the tile steps of the next block
// (PendingRows of Bf16Row), as the gated product's SiLU does.
void gemm_amx_bf16_out(const uint16_t* xb, int64_t M, const at::BFloat16* w, int64_t Kp, const float* bias, int64_t N,
                       int64_t act, uint16_t* out) {
  const int64_t panel_size = Kp * kPanel;
  const int64_t num_steps = std::max<int64_t>(1, Kp / kPairChunk);
  const auto run = [&](int64_t m_block, int64_t m_end, int64_t begin, int64_t end) {
    alignas(64) float acc[2][2 * 32 * kPanel];  // two blocks' sums: the one on the tiles, the one pending
    PendingRows<Bf16Row> pending;
    TileShape shape;
    int cur = 0;
    for (int64_t p = begin; p < end; p += 2) {
      const at::BFloat16* panel = w + p * panel_size;
      const bool pair = p + 1 < end;
      for (int64_t m0 = m_block; m0 < m_end; m0 += 32) {
        const int64_t rows = std::min<int64_t>(32, m_end - m0);
        shape.fit(rows);
        const uint16_t* xm = xb + m0 * Kp;
        float* c0 = acc[cur];
        float* c1 = c0 + 32 * kPanel;
        const bool first = m0 == m_block;
        tile_amx_block(rows, pair, xm, Kp, panel, panel + panel_size, c0, c1, kPanel, false, first, pending);
        pending.finish();
        pending.start(Bf16Row{c0, bias != nullptr ? bias + p * kPanel : nullptr, out + m0 * N + p * kPanel, N,
                              pair ? 2 : 1, act},
                      rows, num_steps);
        cur ^= 1;
      }
    }
    pending.finish();
    release_tiles();
  };
  parallel_amx_tasks(M, N / kPanel, Kp, panel_size * 2, nullptr, run);
}
#endif

// AMX with bf16 products, and the kernel's leave to use the tile registers: Linux (5.16+) hands
// out their state only to a process that asks.
bool can_use_amx_bf16() {
#if defined(MINIVLLM_HAS_AMX)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  constexpr unsigned kAmxBf16 = 1u << 22, kAmxTile = 1u << 24;
  if ((edx & kAmxBf16) == 0 || (edx & kAmxTile) == 0) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

// vdpbf16ps, and a compiler that emits it.
bool can_use_avx512_bf16() {
#if defined(MINIVLLM_HAS_AVX512_BF16)
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}
}  // namespace

int64_t best_isa() {
  // Asked on every product (to refuse a path the CPU lacks): detect once.
  static const int64_t best = [] {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
      return can_use_amx_bf16()                    ? kIsaAmx
             : can_use_avx512_bf16()               ? kIsaAvx512Bf16
                                                   : kIsaAvx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kIsaAvx2;
#endif
    return kIsaScalar;
  }();
  return best;
}

void check_packed_weight(const torch::Tensor& w, int64_t K, int64_t N, const float* scale, int64_t isa) {
  TORCH_CHECK(isa <= best_isa(), "packed_gemm: this CPU lacks the requested instruction set");
  if (w.scalar_type() == torch::kByte && w.dim() == 1) {  // GGUF parts of mixed block types
    TORCH_CHECK(scale == nullptr, "packed_gemm: GGUF block panels take no per-channel scales");
    return check_quant_parts(w, K, N, isa);
  }
  TORCH_CHECK(w.dim() == 3 && w.size(0) * kPanel >= N && w.is_contiguous(),
              "packed_gemm: weight must be [ceil(N/16), K, 16] (bfloat16: [ceil(N/16), Kp/2, 32])");
  switch (w.scalar_type()) {
    case torch::kFloat32:
      TORCH_CHECK(w.size(1) == K && w.size(2) == kPanel, "packed_gemm: float32 weight must be [N/16, K, 16]");
      return;
    case torch::kBFloat16: {
      const int64_t Kp = 2 * w.size(1);
      TORCH_CHECK(w.size(2) == 2 * kPanel && Kp >= K && Kp < K + kPairChunk && Kp % kPairChunk == 0,
                  "packed_gemm: bfloat16 weight must be [N/16, Kp/2, 32], Kp = K rounded up to 32");
      return;
    }
    case torch::kInt8:
      TORCH_CHECK(scale != nullptr, "packed_gemm: int8 weights need per-channel scales");
      TORCH_CHECK(w.size(1) == K && w.size(2) == kPanel, "packed_gemm: int8 weight must be [N/16, K, 16]");
      return;
    case torch::kByte: {
      TORCH_CHECK(scale == nullptr, "packed_gemm: GGUF block panels take no per-channel scales");
      const int64_t type = quant_type_of_record(w.size(2));
      TORCH_CHECK(type != 0, "packed_gemm: uint8 weight records of ", w.size(2),
                  " bytes are no GGUF block type with kernels");
      check_quant_weight(w, type, K, N, isa);
      return;
    }
    default:
      TORCH_CHECK(false, "packed_gemm: weights must be float32, bfloat16, int8 or GGUF block panels (uint8)");
  }
}

std::vector<std::pair<int64_t, int64_t>> tapered_split(int64_t num_panels, int64_t num_ranks) {
  TORCH_CHECK(num_panels >= 0 && num_ranks > 0, "tapered_split: num_panels >= 0, num_ranks > 0");
  const TaperedSplit split(num_panels, num_ranks);
  std::vector<std::pair<int64_t, int64_t>> tasks;
  for (int64_t task = 0; task < split.num_tasks(); ++task) tasks.push_back(split.panels(task));
  return tasks;
}

PackedPanels PackedPanels::of(const torch::Tensor& w) {
  if (w.dim() != 1) return {w.data_ptr(), w.scalar_type(), w.size(0), w.size(1), w.size(2)};
  const auto* bytes = static_cast<const uint8_t*>(w.data_ptr());  // mixed-type parts: their header
  int32_t header[kQuantPartsHeaderBytes / 4];
  std::memcpy(header, bytes, sizeof(header));
  PackedPanels p{bytes + kQuantPartsHeaderBytes, w.scalar_type(), 0, 0, 0, header[0]};
  for (int64_t i = 0; i < p.num_parts; ++i) {
    p.parts[i] = {header[1 + 3 * i], header[2 + 3 * i], header[3 + 3 * i]};
    p.num_panels += p.parts[i].num_panels;
  }
  return p;
}

int64_t PackedPanels::panel_offset(int64_t p) const {
  if (num_parts == 0) return p * rows * width * static_cast<int64_t>(c10::elementSize(dtype));
  int64_t offset = 0;
  for (int64_t i = 0; i < num_parts; ++i) {
    const int64_t panel_bytes = parts[i].num_records * quant_format(parts[i].type).record_bytes();
    if (p < parts[i].num_panels) return offset + p * panel_bytes;
    offset += parts[i].num_panels * panel_bytes;
    p -= parts[i].num_panels;
  }
  return offset;  // p past the last panel: the end
}

void prefetch_team_home(const PackedPanels& w, int64_t num_ranks, int64_t rank, int64_t max_bytes) {
#if defined(__x86_64__)
  const int64_t num_panels = w.num_panels;
  // Its first task's first panel. The AMX path keeps even tasks (gemm_amx), whose homes can start
  // a few panels off this: the request then covers part of the right run (speed, not floats).
  const int64_t first = TaperedSplit::home_begin(num_panels, num_ranks, rank);
  const int64_t begin = w.panel_offset(first);
  const char* start = static_cast<const char*>(w.data) + begin;
  const int64_t bytes = std::min(max_bytes, w.panel_offset(num_panels) - begin);
  for (int64_t offset = 0; offset < bytes; offset += 64) _mm_prefetch(start + offset, _MM_HINT_T1);
#endif
}

void packed_gemm(const float* x, int64_t M, int64_t K, int64_t ldx, const torch::Tensor& w, const float* scale,
                 const float* bias, int64_t N, float* out, int64_t ldo, int64_t isa, bool accumulate,
                 const TeamShare* team) {
  // A team's members must not throw (the others would wait for ever for the part it left): its
  // owner checks the weights once, when it binds them.
  if (team == nullptr) check_packed_weight(w, K, N, scale, isa);
  packed_gemm(x, M, K, ldx, PackedPanels::of(w), scale, bias, N, out, ldo, isa, accumulate, team);
}

void packed_gemm(const float* x, int64_t M, int64_t K, int64_t ldx, const PackedPanels& w, const float* scale,
                 const float* bias, int64_t N, float* out, int64_t ldo, int64_t isa, bool accumulate,
                 const TeamShare* team) {
  const int64_t panel_size = w.rows * w.width;
  switch (w.dtype) {
    case torch::kFloat32:
      return gemm_vector(x, M, ldx, static_cast<const float*>(w.data), panel_size, K, scale, bias, N, out, ldo, isa,
                         accumulate, team);
    case torch::kBFloat16: {
      const auto* data = static_cast<const at::BFloat16*>(w.data);
#if defined(MINIVLLM_HAS_AMX)
      if (isa == kIsaAmx && scale == nullptr)
        return gemm_amx(x, M, ldx, data, 2 * w.rows, K, bias, N, out, ldo, accumulate, team);
#endif
#if defined(MINIVLLM_HAS_AVX512_BF16)
      if (isa == kIsaAvx512Bf16 && scale == nullptr)
        return gemm_dpbf16(x, M, ldx, data, 2 * w.rows, K, bias, N, out, ldo, accumulate, team);
#endif
      return gemm_vector(x, M, ldx, data, panel_size, K, scale, bias, N, out, ldo, isa, accumulate, team);
    }
    case torch::kByte: {  // GGUF blocks: the integer-dot kernels
      if (w.num_parts > 0) {  // mixed types: each part's panels after the one before's
        std::array<QuantPanels, kMaxQuantParts> parts;
        const auto* data = static_cast<const uint8_t*>(w.data);
        for (int64_t i = 0; i < w.num_parts; ++i) {
          const QuantPart& part = w.parts[i];
          const int64_t record_bytes = quant_format(part.type).record_bytes();
          parts[i] = {data, part.type, part.num_panels, part.num_records, record_bytes};
          data += part.num_panels * part.num_records * record_bytes;
        }
        return quant_gemm(x, M, K, ldx, parts.data(), w.num_parts, bias, N, out, ldo, isa, accumulate, team);
      }
      const QuantPanels q{static_cast<const uint8_t*>(w.data), quant_type_of_record(w.width), w.num_panels, w.rows,
                          w.width};
      return quant_gemm(x, M, K, ldx, q, bias, N, out, ldo, isa, accumulate, team);
    }
    default:  // int8 (check_packed_weight allows no other)
      return gemm_vector(x, M, ldx, static_cast<const int8_t*>(w.data), panel_size, K, scale, bias, N, out, ldo, isa,
                         accumulate, team);
  }
}

void packed_gemm_activated(const float* x, int64_t M, int64_t K, int64_t ldx, const torch::Tensor& w,
                           const float* bias, int64_t N, float* out, int64_t ldo, int64_t isa, bool accumulate,
                           int64_t out_act) {
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 || w.scalar_type() == torch::kBFloat16,
              "packed_gemm_activated: float32 or bfloat16 panels only");
  TORCH_CHECK(out_act == kOutNone || out_act == kOutGelu || out_act == kOutGeluTanh,
              "packed_gemm_activated: unknown activation ", out_act);
  check_packed_weight(w, K, N, nullptr, isa);
  const int64_t panel_size = w.size(1) * w.size(2);
  if (w.scalar_type() == torch::kFloat32)
    return gemm_vector(x, M, ldx, w.data_ptr<float>(), panel_size, K, nullptr, bias, N, out, ldo, isa, accumulate,
                       nullptr, out_act);
  // bfloat16 panels: by the path packed_gemm takes, the activation in the same tiles where it can
  const auto* data = static_cast<const at::BFloat16*>(w.data_ptr());
#if defined(MINIVLLM_HAS_AMX)
  if (isa == kIsaAmx) {  // gemm_amx takes no activation: a pass after it, by rows
    gemm_amx(x, M, ldx, data, 2 * w.size(1), K, bias, N, out, ldo, accumulate, nullptr);
    if (out_act != kOutNone) {
      at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
        for (int64_t m = begin; m < end; ++m) activate(out + m * ldo, N, out_act, isa);
      });
    }
    return;
  }
#endif
#if defined(MINIVLLM_HAS_AVX512_BF16)
  if (isa == kIsaAvx512Bf16)
    return gemm_dpbf16(x, M, ldx, data, 2 * w.size(1), K, bias, N, out, ldo, accumulate, nullptr, out_act);
#endif
  gemm_vector(x, M, ldx, data, panel_size, K, nullptr, bias, N, out, ldo, isa, accumulate, nullptr, out_act);
}

bool can_run_gated_mlp(const torch::Tensor& gate_up, int64_t I, const torch::Tensor& down, int64_t act, int64_t isa) {
#if defined(MINIVLLM_HAS_AMX)
  return isa == kIsaAmx && gate_up.scalar_type() == torch::kBFloat16 && down.scalar_type() == torch::kBFloat16 &&
         I % kPanel == 0 && (act == kActSilu || act == kActGeluTanh);
#else
  return false;
#endif
}

void packed_gated_mlp(const float* x, int64_t M, int64_t K, const float* norm, float eps, const torch::Tensor& gate_up,
                      int64_t I, const torch::Tensor& down, int64_t act, float* out, int64_t ldo, bool accumulate,
                      int64_t isa) {
#if defined(MINIVLLM_HAS_AMX)
  TORCH_CHECK(can_run_gated_mlp(gate_up, I, down, act, isa), "packed_gated_mlp: not on these panels or this CPU");
  const int64_t Kp = 2 * gate_up.size(1), Ip = 2 * down.size(1);
  TORCH_CHECK(gate_up.size(0) * kPanel >= 2 * I && Ip >= I && Kp >= K, "packed_gated_mlp: panel shapes");
  const auto xb = norm != nullptr ? normed_rounded_rows(x, M, K, K, norm, eps, Kp) : rounded_rows(x, M, K, K, Kp);
  const auto ab = scratch_array<uint16_t>(M * Ip);  // [M, Ip]: act(g) * u in bfloat16
  gemm_amx_gated(xb.get(), M, gate_up.data_ptr<at::BFloat16>(), Kp, I, act, ab.get(), Ip);
  gemm_amx_rounded(ab.get(), M, down.data_ptr<at::BFloat16>(), Ip, nullptr, ldo, out, ldo, accumulate, nullptr);
#else
  TORCH_CHECK(false, "packed_gated_mlp: a build without AMX");
#endif
}

bool packed_gemm_bf16_out(const float* x, int64_t M, int64_t K, const torch::Tensor& w, const float* bias, int64_t N,
                          int64_t act, uint16_t* out, int64_t isa) {
#if defined(MINIVLLM_HAS_AMX)
  TORCH_CHECK(act == kOutNone || act == kOutGelu || act == kOutGeluTanh, "packed_gemm_bf16_out: unknown activation ",
              act);
  if (isa != kIsaAmx || w.scalar_type() != torch::kBFloat16 || N % kPairChunk != 0) return false;
  check_packed_weight(w, K, N, nullptr, isa);
  const int64_t Kp = 2 * w.size(1);
  const auto xb = rounded_rows(x, M, K, K, Kp);
  gemm_amx_bf16_out(xb.get(), M, w.data_ptr<at::BFloat16>(), Kp, bias, N, act, out);
  return true;
#else
  return false;
#endif
}

bool packed_gemm_bf16_rows(const uint16_t* xb, int64_t M, int64_t K, const torch::Tensor& w, const float* bias,
                           int64_t N, float* out, int64_t ldo, bool accumulate, int64_t isa) {
#if defined(MINIVLLM_HAS_AMX)
  if (isa != kIsaAmx || w.scalar_type() != torch::kBFloat16 || K % kPairChunk != 0) return false;
  check_packed_weight(w, K, N, nullptr, isa);
  gemm_amx_rounded(xb, M, w.data_ptr<at::BFloat16>(), K, bias, N, out, ldo, accumulate, nullptr);
  return true;
#else
  return false;
#endif
}

bool packed_gemm_normed(const float* x, int64_t M, int64_t K, const float* norm, float eps, const torch::Tensor& w,
                        const float* scale, const float* bias, int64_t N, float* out, int64_t ldo, int64_t isa) {
#if defined(MINIVLLM_HAS_AMX)
  if (isa != kIsaAmx || w.scalar_type() != torch::kBFloat16 || scale != nullptr) return false;
  check_packed_weight(w, K, N, scale, isa);
  const int64_t Kp = 2 * w.size(1);
  const auto xb = normed_rounded_rows(x, M, K, K, norm, eps, Kp);
  gemm_amx_rounded(xb.get(), M, w.data_ptr<at::BFloat16>(), Kp, bias, N, out, ldo, false, nullptr);
  return true;
#else
  return false;
#endif
}

// x: [M, K] (any float dtype) -> [M, n] float32; bf16_out: [M, n] bfloat16, those values rounded
// to nearest-even (from the tiles' epilogue where bfloat16 panels run on AMX and n is a multiple
// of 32).
torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& w, const std::optional<torch::Tensor>& scale,
                            const std::optional<torch::Tensor>& bias, int64_t n, int64_t isa, bool bf16_out) {
  TORCH_CHECK(x.dim() == 2, "packed_linear: x must be [M, K]");
  const auto xf = x.to(torch::kFloat32).contiguous();
  const float* scale_data = scale ? scale->data_ptr<float>() : nullptr;
  const float* bias_data = bias ? bias->data_ptr<float>() : nullptr;
  if (bf16_out && scale_data == nullptr) {
    auto out = scratch_tensor({x.size(0), n}, xf.options().dtype(torch::kBFloat16));
    if (packed_gemm_bf16_out(xf.data_ptr<float>(), x.size(0), x.size(1), w, bias_data, n, kOutNone,
                             reinterpret_cast<uint16_t*>(out.data_ptr()), isa))
      return out;
  }
  const auto out = scratch_tensor({x.size(0), n}, xf.options());
  packed_gemm(xf.data_ptr<float>(), x.size(0), x.size(1), x.size(1), w, scale_data, bias_data, n,
              out.data_ptr<float>(), n, isa, false);
  return bf16_out ? out.to(torch::kBFloat16) : out;
}

}  // namespace minivllm
