// The row-wise parts of a decoder layer and the view of a packed projection, shared by the
// per-layer kernel (decode_layer.cpp) and the whole-model decode step (decode_model.cpp).
#pragma once

#include "cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <new>
#include <numeric>
#include <tuple>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>

#include "simd_exp.h"
#endif

namespace minivllm {

// torch's tanh GELU, 0.5 x (1 + tanh(beta (x + kappa x^3))), its constants as ATen spells them:
// the decoder's gated GeGLU (Gemma) and the encoder's up projection (BERT's gelu_new) share it.
constexpr float kGeluBeta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5);  // sqrt(2 / pi)
constexpr float kGeluKappa = 0.044715f;

inline float gelu_tanh(float x) { return 0.5f * x * (1.f + std::tanh(kGeluBeta * (x + kGeluKappa * (x * x * x)))); }

#if defined(__x86_64__)
// gelu_tanh over 16 lanes: tanh(y) as 1 - 2 / (1 + e^2y) on exp512 (within about an ulp of 1 of
// torch's tanh, which is what 1 + tanh(y) sees), saturating to +-1 where e^2y overflows or exp512 clamps.
__attribute__((target("avx512f,fma"))) inline __m512 gelu_tanh512(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.f), two = _mm512_set1_ps(2.f);
  const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
  const __m512 inner =
      _mm512_mul_ps(_mm512_set1_ps(kGeluBeta), _mm512_add_ps(x, _mm512_mul_ps(_mm512_set1_ps(kGeluKappa), cube)));
  const __m512 t = _mm512_sub_ps(one, _mm512_div_ps(two, _mm512_add_ps(one, exp512(_mm512_mul_ps(two, inner)))));
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x), _mm512_add_ps(one, t));
}

// The exact GELU, 0.5 x (1 + erf(x / sqrt 2)), as relu(x) - f(|x|), f(a) = a Q(a) with Q(a) =
// 0.5 erfc(a / sqrt 2) the normal tail (x Phi(x) is x - x Q(x) for x >= 0 and x Q(-x) below): erfc
// by Abramowitz and Stegun 7.1.26 (erf's absolute error 1.5e-7), erfc(z) = q(t) e^(-z^2), t = 1 /
// (1 + p z), with e^(-a^2 / 2) as exp2 of -(a k)^2, k^2 = log2(e) / 2. 25 operations a vector
// against 31 written as 0.5 x (1 + erf) with exp512: the up projection's epilogue is bound by the
// vector ports' issue rate, which it shares with the tile products. Absolute error 3.3e-7 over
// [-9, 9] against erfc in double (4.1e-7 before), the float rounding of large x's included.
__attribute__((target("avx512f,fma"))) inline __m512 gelu_erf512(__m512 x) {
  const __m512 a = _mm512_abs_ps(x);
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 t = _mm512_div_ps(one, _mm512_fmadd_ps(_mm512_set1_ps(0.3275911f * static_cast<float>(M_SQRT1_2)), a, one));
  static constexpr float kHalfCoefficients[] = {0.5f * 1.061405429f, 0.5f * -1.453152027f, 0.5f * 1.421413741f,
                                                0.5f * -0.284496736f, 0.5f * 0.254829592f};
  const __m512 q = _mm512_mul_ps(horner512(t, kHalfCoefficients), t);  // 0.5 q(t)
  const __m512 ak = _mm512_mul_ps(a, _mm512_set1_ps(0.8493218002880191f));  // k = sqrt(log2(e) / 2)
  // -(a k)^2, bounded below so that 2^u's reduction takes finite arguments (x = +-inf still gives
  // NaN, as torch's GELU does: q is 0 there and f = 0 x inf)
  const __m512 u = _mm512_max_ps(_mm512_fnmadd_ps(ak, ak, _mm512_setzero_ps()), _mm512_set1_ps(-150.f));
  const __m512 f = _mm512_mul_ps(_mm512_mul_ps(q, exp2_finite_512(u)), a);
  return _mm512_sub_ps(_mm512_max_ps(x, _mm512_setzero_ps()), f);
}

// silu(g) * u = g / (1 + e^-g) * u over 16 lanes (silu_mul's and the AMX gated product's).
__attribute__((target("avx512f,fma"))) inline __m512 silu_mul512(__m512 g, __m512 u) {
  const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)), u);
}
#endif

// Rows per task of the row-wise parts (norms, RoPE, SiLU): a decode step's few rows stay on
// the calling thread; a prefill chunk's hundreds are shared, not left to one core while the
// other spins at the next product's barrier.
constexpr int64_t kRowGrain = 16;

// a[i] = silu(g[i]) * u[i], i < n.
void silu_mul(const float* g, const float* u, float* a, int64_t n, int64_t isa);
// a[i] = gelu_tanh(g[i]) * u[i], i < n: torch's GELU with approximate='tanh'.
void gelu_tanh_mul(const float* g, const float* u, float* a, int64_t n, int64_t isa);
// The gated MLP's act(g) * u by its Activation kind.
inline void gated_act(const float* g, const float* u, float* a, int64_t n, int64_t act, int64_t isa) {
  if (act == kActSilu)
    silu_mul(g, u, a, n, isa);
  else
    gelu_tanh_mul(g, u, a, n, isa);
}

// One row: out = x * rsqrt(mean(x^2) + eps) * weight, as transformers' LlamaRMSNorm in float32
// (out may be x).
inline void rms_norm_row(const float* x, int64_t width, const float* weight, float eps, float* out) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < width; ++i) sum += x[i] * x[i];
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(width) + eps);
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) out[i] = weight[i] * (x[i] * inv);
}
// rms_norm_row of rows of `width` (out may be x). Rows run in parallel outside a parallel region.
void rms_norm(const float* x, int64_t M, int64_t width, const float* weight, float eps, float* out);
// x[m] += RMSNorm(y[m]), rows of `width`, one thread: Gemma's residual add of a normed
// projection output. y is overwritten by its norm: stored before the add, so that no FMA fuses
// the norm's product into the add (torch rounds the norm first).
inline void add_rms_normed(float* y, int64_t M, int64_t width, const float* weight, float eps, float* x) {
  for (int64_t m = 0; m < M; ++m) {
    float* ym = y + m * width;
    float* xm = x + m * width;
    rms_norm_row(ym, width, weight, eps, ym);
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) xm[i] += ym[i];
  }
}
// Rotate-half RoPE of `num_heads` heads of one token in place: cos, sin [D].
void rope(float* heads, int64_t num_heads, int64_t head_dim, const float* cos, const float* sin);

// A scratch array every element of which is written before it is read: no zeroing (a memset of
// a prefill chunk's MLP activations is a noticeable part of its step). On 64-byte lines: a
// team's products store whole panel rows there past the caches (packed_gemm's stream_rows).
using ScratchFloats = Scratch<float>;
inline ScratchFloats scratch_floats(int64_t n) { return scratch_array<float>(n); }

// src[0:count] into elements [offset, offset + count) of a cache row at `slot` (rows of
// kv_size elements), in the cache's dtype.
template <typename cache_t>
void write_cache(cache_t* cache, int64_t slot, int64_t kv_size, int64_t offset, const float* src, int64_t count) {
  cache_t* dst = cache + slot * kv_size + offset;
  for (int64_t i = 0; i < count; ++i) dst[i] = static_cast<cache_t>(src[i]);
}

// A decode step's attention tasks. One per sequence, whose K and V rows (all KV heads) then
// stream once; at a batch too small to keep every thread busy, one per (sequence, KV head),
// each reading a third of a row (with SmolLM2's 3 KV heads), so the threads share even a single
// sequence. Sequences' contexts differ in length: the longest first, each thread taking the
// next task from a shared counter, so the threads finish together (an even split of rows left
// one thread spinning for much of a batch-32 step).
//
// A chain is rows of one sequence at consecutive positions (a verification of proposed tokens:
// its last token and each draft, as decode rows): a task takes a chain's rows in order, since
// each row writes its K and V before it attends and the next row reads them.
class DecodeAttentionTasks {
 public:
  // chain_lengths: rows per chain, in row order (empty: every row its own chain).
  DecodeAttentionTasks(const int64_t* context_lens, int64_t M, int64_t num_kv_heads, int64_t num_threads,
                       const std::vector<int64_t>& chain_lengths = {}) {
    if (chain_lengths.empty()) {
      for (int64_t m = 0; m < M; ++m) chains_.push_back({m, 1});
    } else {
      int64_t first = 0;
      for (const int64_t n : chain_lengths) {
        chains_.push_back({first, n});
        first += n;
      }
    }
    const auto num_chains = static_cast<int64_t>(chains_.size());
    heads_per_task_ = num_chains >= 4 * num_threads ? num_kv_heads : 1;
    tasks_per_chain_ = num_kv_heads / heads_per_task_;
    std::stable_sort(chains_.begin(), chains_.end(), [&](const Chain& a, const Chain& b) {
      return context_lens[a.first + a.count - 1] > context_lens[b.first + b.count - 1];
    });
  }

  int64_t size() const { return static_cast<int64_t>(chains_.size()) * tasks_per_chain_; }
  int64_t heads_per_task() const { return heads_per_task_; }
  // Task -> (its chain's first row, the chain's rows, its first KV head); it covers
  // heads_per_task() KV heads of each of the chain's rows, in order.
  std::tuple<int64_t, int64_t, int64_t> operator[](int64_t task) const {
    const Chain& chain = chains_[task / tasks_per_chain_];
    return {chain.first, chain.count, (task % tasks_per_chain_) * heads_per_task_};
  }

 private:
  struct Chain {
    int64_t first, count;
  };
  std::vector<Chain> chains_;
  int64_t heads_per_task_ = 1, tasks_per_chain_ = 1;
};

// A packed projection's parts as the kernels take them.
struct LinearView {
  const torch::Tensor& w;
  const float* scale;
  const float* bias;
  int64_t n;
};

inline LinearView view(const PackedLinear& linear) {
  const auto& [w, scale, bias, n] = linear;
  TORCH_CHECK(!scale || scale->scalar_type() == torch::kFloat32, "decode_layer: float32 scales");
  TORCH_CHECK(!bias || bias->scalar_type() == torch::kFloat32, "decode_layer: float32 bias");
  return {w, scale ? scale->data_ptr<float>() : nullptr, bias ? bias->data_ptr<float>() : nullptr, n};
}

}  // namespace minivllm
