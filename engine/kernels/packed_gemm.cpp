// Matrix products against weights packed for small batches (the decode step), for the CPU.
//
// At batch 1 a decode step is a chain of matrix-vector products whose cost is reading the
// weights once. The weights are packed in panels of 16 output channels, [ceil(N/16), K, 16]:
// a panel is one contiguous stream, each k gives one vector of 16 weights, and each row of x
// contributes one broadcast multiply-add into 16 outputs, so no horizontal sums are needed and
// any K works (no multiple of the vector width required). Weights are float32, bfloat16
// (widened by a shift) or int8 with a scale per output channel (widened, scaled once at the
// end): activations stay float32, only the weights are narrowed.
//
// Two SIMD paths, chosen at run time by the caller (`isa`): AVX-512 (16 lanes, up to 8 rows per
// tile) and AVX2 + FMA (two 8-lane halves, up to 4 rows per tile); plus plain C++ elsewhere.
// Each tile keeps 8 independent accumulators (rows x unrolled k) so the multiply-adds do not
// wait on each other at batch 1.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace minivllm {
namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kRowBlock = 64;  // rows of x kept hot in cache while a task walks its panels
constexpr int64_t kTasksPerThread = 4;
// Weights are requested this far ahead of use: a layer's matrices are a few hundred KB each,
// too short a stream for the hardware prefetcher to reach full speed on its own.
constexpr int64_t kPrefetchBytes = 4096;

inline float widen(float v) { return v; }
inline float widen(at::BFloat16 v) { return static_cast<float>(v); }
inline float widen(int8_t v) { return static_cast<float>(v); }

template <typename T>
void tile_scalar(const float* x, int64_t rows, int64_t ldx, const T* w, int64_t K, float* acc) {
  std::fill(acc, acc + rows * kPanel, 0.f);
  for (int64_t k = 0; k < K; ++k) {
    const T* wk = w + k * kPanel;
    for (int64_t m = 0; m < rows; ++m) {
      const float xv = x[m * ldx + k];
      for (int64_t j = 0; j < kPanel; ++j) acc[m * kPanel + j] += xv * widen(wk[j]);
    }
  }
}

#if defined(__x86_64__)
#define MINIVLLM_AVX512 __attribute__((target("avx512f,avx512bw,fma")))
#define MINIVLLM_AVX2 __attribute__((target("avx2,fma")))

MINIVLLM_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
MINIVLLM_AVX512 inline __m512 load16(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
MINIVLLM_AVX512 inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// MT rows x 16 outputs; U consecutive k run in separate accumulators, summed at the end.
template <int MT, int U, typename T>
MINIVLLM_AVX512 void tile_avx512(const float* x, int64_t ldx, const T* w, int64_t K, float* acc_out) {
  __m512 acc[MT][U];
  for (int m = 0; m < MT; ++m)
    for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + U <= K; k += U) {
    for (int u = 0; u < U; ++u) {
      if ((u * kPanel * sizeof(T)) % 64 == 0)
        _mm_prefetch(reinterpret_cast<const char*>(w + (k + u) * kPanel) + kPrefetchBytes, _MM_HINT_T0);
      const __m512 wv = load16(w + (k + u) * kPanel);
      for (int m = 0; m < MT; ++m) acc[m][u] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[m * ldx + k + u]), acc[m][u]);
    }
  }
  for (; k < K; ++k) {
    const __m512 wv = load16(w + k * kPanel);
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
  for (int64_t k = 0; k < K; ++k) {
    if ((k * kPanel * sizeof(T)) % 64 == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(w0 + k * kPanel) + kPrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w1 + k * kPanel) + kPrefetchBytes, _MM_HINT_T0);
    }
    const __m512 a = load16(w0 + k * kPanel), b = load16(w1 + k * kPanel);
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

// The 16 weights of one k as two 8-lane halves.
MINIVLLM_AVX2 inline void load8x2(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}
MINIVLLM_AVX2 inline void load8x2(const at::BFloat16* p, __m256& lo, __m256& hi) {
  const __m128i* q = reinterpret_cast<const __m128i*>(p);
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(q)), 16));
  hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(q + 1)), 16));
}
MINIVLLM_AVX2 inline void load8x2(const int8_t* p, __m256& lo, __m256& hi) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
}

template <int MT, int U, typename T>
MINIVLLM_AVX2 void tile_avx2(const float* x, int64_t ldx, const T* w, int64_t K, float* acc_out) {
  __m256 lo[MT][U], hi[MT][U];
  for (int m = 0; m < MT; ++m)
    for (int u = 0; u < U; ++u) lo[m][u] = hi[m][u] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + U <= K; k += U) {
    for (int u = 0; u < U; ++u) {
      if ((u * kPanel * sizeof(T)) % 64 == 0)
        _mm_prefetch(reinterpret_cast<const char*>(w + (k + u) * kPanel) + kPrefetchBytes, _MM_HINT_T0);
      __m256 wl, wh;
      load8x2(w + (k + u) * kPanel, wl, wh);
      for (int m = 0; m < MT; ++m) {
        const __m256 xv = _mm256_set1_ps(x[m * ldx + k + u]);
        lo[m][u] = _mm256_fmadd_ps(wl, xv, lo[m][u]);
        hi[m][u] = _mm256_fmadd_ps(wh, xv, hi[m][u]);
      }
    }
  }
  for (; k < K; ++k) {
    __m256 wl, wh;
    load8x2(w + k * kPanel, wl, wh);
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

int64_t max_tile_rows(int64_t isa) { return isa == kIsaAvx512 ? 8 : 4; }

// acc[rows, 16] = x[rows, K] . panel, by the chosen path.
template <typename T>
void run_tile(int64_t isa, int64_t rows, const float* x, int64_t ldx, const T* w, int64_t K, float* acc) {
#if defined(__x86_64__)
  if (isa == kIsaAvx512) {
    switch (rows) {
      case 1: return tile_avx512<1, 8>(x, ldx, w, K, acc);
      case 2: return tile_avx512<2, 4>(x, ldx, w, K, acc);
      case 3: return tile_avx512<3, 2>(x, ldx, w, K, acc);
      case 4: return tile_avx512<4, 2>(x, ldx, w, K, acc);
      case 5: return tile_avx512<5, 1>(x, ldx, w, K, acc);
      case 6: return tile_avx512<6, 1>(x, ldx, w, K, acc);
      case 7: return tile_avx512<7, 1>(x, ldx, w, K, acc);
      default: return tile_avx512<8, 1>(x, ldx, w, K, acc);
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
  if (isa == kIsaAvx512) {
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

// out rows [m0, m0 + rows), columns [n0, n0 + width) from acc[rows, 16].
inline void store_tile(const float* acc, int64_t rows, int64_t m0, int64_t n0, int64_t width, const float* scale,
                       const float* bias, float* out, int64_t ldo, bool accumulate) {
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + (m0 + r) * ldo + n0;
    for (int64_t j = 0; j < width; ++j) {
      float v = acc[r * kPanel + j];
      if (scale != nullptr) v *= scale[n0 + j];
      if (bias != nullptr) v += bias[n0 + j];
      o[j] = accumulate ? o[j] + v : v;
    }
  }
}

template <typename T>
void gemm_typed(const float* x, int64_t M, int64_t ldx, const T* w, int64_t K, const float* scale, const float* bias,
                int64_t N, float* out, int64_t ldo, int64_t isa, bool accumulate) {
  const int64_t num_panels = (N + kPanel - 1) / kPanel;
  const int64_t tile_rows = max_tile_rows(isa);
  // Tasks of a few panels each (for one block of rows), taken from a shared counter rather than
  // split evenly up front: a thread the OS preempts (a serving process's event loop, a client
  // on the same cores) then delays its own tasks only, not the whole product.
  const int64_t num_threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t chunk = std::max<int64_t>(1, (num_panels + kTasksPerThread * num_threads - 1) /
                                                 (kTasksPerThread * num_threads));
  const int64_t num_chunks = (num_panels + chunk - 1) / chunk;
  const int64_t num_tasks = num_chunks * ((M + kRowBlock - 1) / kRowBlock);
  std::atomic<int64_t> next_task{0};
  at::parallel_for(0, std::min(num_threads, num_tasks), 1, [&](int64_t, int64_t) {
    alignas(64) float acc[2 * 8 * kPanel];
    for (int64_t task = next_task++; task < num_tasks; task = next_task++) {
      const int64_t m_block = (task / num_chunks) * kRowBlock, m_end = std::min(M, m_block + kRowBlock);
      const int64_t begin = (task % num_chunks) * chunk, end = std::min(num_panels, begin + chunk);
      for (int64_t p = begin; p < end;) {
        const T* panel = w + p * K * kPanel;
        const int64_t n0 = p * kPanel, width = std::min(kPanel, N - n0);
        // Two panels a tile where the tile is compute bound (several rows); one otherwise.
        const bool pair = p + 1 < end;
        const int64_t width1 = pair ? std::min(kPanel, N - n0 - kPanel) : 0;
        for (int64_t m0 = m_block; m0 < m_end; m0 += tile_rows) {
          const int64_t rows = std::min(tile_rows, m_end - m0);
          if (pair && run_tile2(isa, rows, x + m0 * ldx, ldx, panel, panel + K * kPanel, K, acc)) {
            store_tile(acc, rows, m0, n0, width, scale, bias, out, ldo, accumulate);
            store_tile(acc + rows * kPanel, rows, m0, n0 + kPanel, width1, scale, bias, out, ldo, accumulate);
            continue;
          }
          // One panel at a time (too few rows for the pair): in memory order, for the prefetcher.
          run_tile(isa, rows, x + m0 * ldx, ldx, panel, K, acc);
          store_tile(acc, rows, m0, n0, width, scale, bias, out, ldo, accumulate);
          if (pair) {
            run_tile(isa, rows, x + m0 * ldx, ldx, panel + K * kPanel, K, acc);
            store_tile(acc, rows, m0, n0 + kPanel, width1, scale, bias, out, ldo, accumulate);
          }
        }
        p += pair ? 2 : 1;
      }
    }
  });
}

}  // namespace

int64_t best_isa() {
  // Asked on every product (to refuse a path the CPU lacks): detect once.
  static const int64_t best = [] {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return kIsaAvx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kIsaAvx2;
#endif
    return kIsaScalar;
  }();
  return best;
}

void packed_gemm(const float* x, int64_t M, int64_t ldx, const torch::Tensor& w, const float* scale,
                 const float* bias, int64_t N, float* out, int64_t ldo, int64_t isa, bool accumulate) {
  TORCH_CHECK(w.dim() == 3 && w.size(2) == kPanel && w.is_contiguous(), "packed_gemm: weight must be [N/16, K, 16]");
  TORCH_CHECK(w.size(0) * kPanel >= N, "packed_gemm: weight has fewer than N output channels");
  TORCH_CHECK(isa <= best_isa(), "packed_gemm: this CPU lacks the requested instruction set");
  const int64_t K = w.size(1);
  switch (w.scalar_type()) {
    case torch::kFloat32:
      return gemm_typed(x, M, ldx, w.data_ptr<float>(), K, scale, bias, N, out, ldo, isa, accumulate);
    case torch::kBFloat16:
      return gemm_typed(x, M, ldx, w.data_ptr<at::BFloat16>(), K, scale, bias, N, out, ldo, isa, accumulate);
    case torch::kInt8:
      TORCH_CHECK(scale != nullptr, "packed_gemm: int8 weights need per-channel scales");
      return gemm_typed(x, M, ldx, w.data_ptr<int8_t>(), K, scale, bias, N, out, ldo, isa, accumulate);
    default:
      TORCH_CHECK(false, "packed_gemm: weights must be float32, bfloat16 or int8");
  }
}

// x: [M, K] (any float dtype) -> [M, n] float32.
torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& w, const std::optional<torch::Tensor>& scale,
                            const std::optional<torch::Tensor>& bias, int64_t n, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.size(1), "packed_linear: x must be [M, K] with the weight's K");
  const auto xf = x.to(torch::kFloat32).contiguous();
  const auto out = torch::empty({x.size(0), n}, xf.options());
  const float* scale_data = scale ? scale->data_ptr<float>() : nullptr;
  const float* bias_data = bias ? bias->data_ptr<float>() : nullptr;
  packed_gemm(xf.data_ptr<float>(), x.size(0), x.size(1), w, scale_data, bias_data, n, out.data_ptr<float>(), n, isa,
              false);
  return out;
}

}  // namespace minivllm
