// Causal attention of one prefill chunk over its sequence's paged KV cache, for the CPU: the
// flash-attention loop (online softmax over blocks of keys) with the chunk's own K/V already
// written to the cache, so a chunk after a cached context needs no gather, no mask tensor and
// no log-sum-exp merge, and a first chunk skips the keys above the diagonal.
//
// Per KV head, the context's keys are first laid out as panels [blocks of 16 keys, D, 16] and
// its values as rows [L, D] in float32 (bf16 caches are widened once here, not per query); a
// float32 cache whose blocks hold whole 16-key blocks keeps its values where they are, read in
// place through the block table (no copy per chunk). A task then takes up to 8 neighbouring
// tiles of up to 8 query rows (the `group` query heads of a few tokens, GQA) and walks the keys
// they may see, 64 a step: scores as a small matrix product (one broadcast multiply-add into 16
// keys per row and dimension), an exponential evaluated lane-wise, and the weighted values
// accumulated per row, all in AVX-512 registers.
// A row's running maximum is raised only when a score passes it by more than 8 (log2 units), as
// FlashAttention-4 does: most steps then need no maximum across lanes and no rescaling.
// Elsewhere (or for head sizes not a multiple of 16) a portable loop over 16-key blocks runs,
// written for the compiler to vectorize; it is slower than torch's flash kernel, so the engine
// routes only AVX-512 CPUs here.
//
// A bfloat16 cache on an AVX512-BF16 CPU (kIsaAvx512Bf16 and up) takes the pair path instead of
// widening: its panels keep the cache's bfloat16 values, two in each 32-bit element, and both
// products run on vdpbf16ps (two multiply-adds a lane, twice the FMA's rate), with q and the
// probabilities rounded to bfloat16 and everything summed in float32, as FlashAttention's bf16
// kernels round P: faster than the widened path, its error on a par with torch's bf16 SDPA.
// On an AMX CPU (kIsaAmx, head_dim a multiple of 32) the same panels feed the tile unit instead
// (attend_tiles_amx below): both products as tile products, the softmax between them unchanged.
#include "amx_tiles.h"
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>

#include "simd_exp.h"  // exp2_512: 2^x lane-wise
#endif

// As in packed_gemm.cpp: vdpbf16ps needs GCC 11 or clang, and best_isa() offers kIsaAvx512Bf16
// only where it was built.
#if defined(MINIVLLM_HAS_AMX)  // the AMX tiles' intrinsics and vdpbf16ps come with the same compilers
#define MINIVLLM_HAS_AVX512_BF16 1
#endif

namespace minivllm {
namespace {

constexpr int64_t kKeys = 16;  // keys per block: one 16-float vector of scores per query row
constexpr int64_t kRows = 8;   // query rows per tile

// A bfloat16 cache's pair path (AVX512-BF16) holds two bfloat16 values in each 32-bit element of
// its panels, vdpbf16ps's operand: a pair of dimensions of a key (K) or a pair of keys of a
// value column (V). Values an element holds: 1 (float32) or 2 (a pair).
using Bf16Pair = uint32_t;
template <typename E>
constexpr int64_t kPerElement = std::is_same_v<E, float> ? 1 : 2;
// How far (log2 units) a row's scores may rise above its running maximum before the AVX-512
// path rescales: probabilities up to 2^8, far from float32's range (the sums stay below 2^8 per
// key), and exact: o / l is the same for any common scale of a row's probabilities.
constexpr float kRescaleSlack = 8.f;

// Strides (in floats) of q's and out's [tokens, heads, D] rows: q may be a slice of the fused
// QKV output and out a slice of a larger output, read and written in place (no copy of either).
struct RowStrides {
  int64_t q_token, q_head, out_token, out_head;
};

// Where a chunk's keys and values are and who sees them. The default: a paged cache of
// [slots, KVH, D] rows, each query seeing the keys up to its own position (causal). An encoder's
// prompt (packed_bidirectional_attention) reads its K and V in place from the fused QKV output,
// slot_stride floats a token, and every query sees every key of the prompt.
struct KeySource {
  int64_t slot_stride = 0;  // floats between tokens' rows; 0: KVH * D (a cache's rows)
  bool is_bidirectional = false;
};

// Where a step's values are: row i of its 16-key block b at blocks[b] + i * stride (a pair path's
// block has 8 rows, each a pair of keys). Rows of the chunk's own copy, or (a float32 cache whose
// blocks hold whole 16-key blocks) the cache's rows in place, with no copy per chunk.
template <typename E>
struct ValueRows {
  const E* const* blocks;
  int64_t stride;
};

// e^x for x <= 0 (a score minus the running maximum) in plain arithmetic the compiler can
// vectorize: 2^(x log2 e) split into an integer power (built in the exponent bits) and a
// degree-6 polynomial on [-ln2/2, ln2/2] (Cephes' expf coefficients, about 1 ulp).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;  // x - n ln2, in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Keys [first, first + count) (count <= 16) of one KV head, as one panel [D, 16] (zero past the
// last key) and value rows [count, D], in float32.
template <typename cache_t>
void gather_block(const cache_t* k_cache, const cache_t* v_cache, const int64_t* table, int64_t block_size,
                  int64_t slot_stride, int64_t head_offset, int64_t head_dim, int64_t first, int64_t count,
                  float* panel, float* v_rows) {
  if (count < kKeys) std::fill(panel, panel + head_dim * kKeys, 0.f);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t t = first + i;
    const int64_t slot = paged_slot(table, block_size, t);
    const cache_t* k = k_cache + slot * slot_stride + head_offset;
    const cache_t* v = v_cache + slot * slot_stride + head_offset;
    for (int64_t d = 0; d < head_dim; ++d) panel[d * kKeys + i] = static_cast<float>(k[d]);
    if (v_rows == nullptr) continue;  // values read in place
    float* vr = v_rows + i * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) vr[d] = static_cast<float>(v[d]);
  }
}

// The running state of R query rows (one tile): scaled queries, output accumulators, softmax
// maximum and sum, positions.
template <int R>
struct TileState {
  alignas(64) float qs[R][256];
  alignas(64) float o[R][256];
  alignas(64) float p[R][64];
  alignas(64) float l_lanes[R][16];  // the AVX-512 path's softmax sums, per lane until the end
  alignas(64) Bf16Pair q_pairs[R][128];  // the pair path's qs, rounded to bfloat16, 2 dimensions a pair
  alignas(64) uint16_t p_bf16[R][64];    // the pair path's p, rounded to bfloat16
  int64_t pos[R];
  float m[R], l[R];
  int64_t lo, hi;  // keys this tile may see: [lo, hi) in context positions
};

// Rows [row_begin, row_begin + rows) (rows <= R) of the (token, group head) rows of one KV head.
template <int R>
void init_tile(TileState<R>& t, int64_t rows, const float* q, int64_t row_begin, int64_t group, int64_t kv_head,
               const RowStrides& strides, int64_t head_dim, int64_t start_pos, int64_t shared_pos, int64_t first_key,
               int64_t window, float scale, bool is_pairs = false) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = row_begin + r, token = row / group, h = kv_head * group + row % group;
    t.pos[r] = shared_pos >= 0 ? shared_pos : start_pos + token;
    const float* qr = q + token * strides.q_token + h * strides.q_head;
    for (int64_t d = 0; d < head_dim; ++d) t.qs[r][d] = qr[d] * scale;
    if (is_pairs) {
      for (int64_t d = 0; d < head_dim; d += 2)  // rounded to nearest even, as torch rounds to bfloat16
        t.q_pairs[r][d / 2] = static_cast<Bf16Pair>(c10::BFloat16(t.qs[r][d]).x) |
                              static_cast<Bf16Pair>(c10::BFloat16(t.qs[r][d + 1]).x) << 16;
    }
    std::fill(t.o[r], t.o[r] + head_dim, 0.f);
    std::fill(t.l_lanes[r], t.l_lanes[r] + 16, 0.f);
    t.m[r] = -std::numeric_limits<float>::infinity();
    t.l[r] = 0.f;
  }
  t.hi = t.pos[rows - 1] + 1;
  t.lo = window > 0 ? std::max<int64_t>(first_key, t.pos[0] - window + 1) : first_key;
}

// sinks: every query head's sink logit [H] (gpt-oss), or null: it joins each row's denominator
// here, once, with no value (m and l are in log2 units when is_log2, as the AVX-512 tiles keep them).
template <int R>
void finish_tile(const TileState<R>& t, int64_t rows, int64_t row_begin, int64_t group, int64_t kv_head,
                 const RowStrides& strides, int64_t head_dim, float* out, const float* sinks, bool is_log2) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = row_begin + r, token = row / group, h = kv_head * group + row % group;
    float* dst = out + token * strides.out_token + h * strides.out_head;
    float inv = 1.f / t.l[r];
    if (sinks) {  // o / (l + e^(sink - m)), both terms taken relative to the larger of m and the sink
      const float sink = is_log2 ? sinks[h] * 1.44269504088896341f : sinks[h];
      const float top = std::max(t.m[r], sink);
      const float keys = is_log2 ? std::exp2(t.m[r] - top) : std::exp(t.m[r] - top);
      const float rest = is_log2 ? std::exp2(sink - top) : std::exp(sink - top);
      inv = keys / (t.l[r] * keys + rest);
    }
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = t.o[r][d] * inv;
  }
}

// One tile by the portable loop: rows [row_begin, row_end) of one KV head.
void attend_tile(const float* q, int64_t row_begin, int64_t row_end, int64_t group, int64_t kv_head,
                 const RowStrides& strides, int64_t head_dim, int64_t start_pos, int64_t shared_pos, int64_t first_key,
                 int64_t window, float scale, const float* k_panels, const float* v_rows, float* out,
                 const float* sinks) {
  const int64_t R = row_end - row_begin;
  TileState<kRows> t;
  init_tile(t, R, q, row_begin, group, kv_head, strides, head_dim, start_pos, shared_pos, first_key, window, scale);
  auto &qs = t.qs, &o = t.o;
  auto& pos = t.pos;
  auto &m = t.m, &l = t.l;
  const int64_t lo = t.lo, hi = t.hi;
  const int64_t block_lo = (lo - first_key) / kKeys, block_hi = (hi - first_key + kKeys - 1) / kKeys;
  for (int64_t b = block_lo; b < block_hi; ++b) {
    const float* panel = k_panels + b * head_dim * kKeys;
    const int64_t key0 = first_key + b * kKeys;
    float s[kRows][kKeys] = {};
    for (int64_t d = 0; d < head_dim; ++d) {
      const float* kd = panel + d * kKeys;
      for (int64_t r = 0; r < R; ++r) {
        const float qv = qs[r][d];
#pragma omp simd
        for (int64_t j = 0; j < kKeys; ++j) s[r][j] += qv * kd[j];
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      // Key key0 + j is visible to row r when key0 + j <= pos and (no window or > pos - window).
      const int64_t visible_hi = pos[r] + 1 - key0;  // j < this
      const int64_t visible_lo = window > 0 ? pos[r] - window + 1 - key0 : -kKeys;  // j >= this
      if (visible_hi <= 0 || visible_lo >= kKeys) continue;
      float block_max = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < kKeys; ++j) {
        if (j >= visible_hi || j < visible_lo) s[r][j] = -std::numeric_limits<float>::infinity();
        block_max = std::max(block_max, s[r][j]);
      }
      const float m_new = std::max(m[r], block_max);
      const float alpha = exp_nonpositive(m[r] - m_new);  // 0 on the first block (m = -inf clamps)
      float p[kKeys];
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < kKeys; ++j) {
        p[j] = s[r][j] == -std::numeric_limits<float>::infinity() ? 0.f : exp_nonpositive(s[r][j] - m_new);
        sum += p[j];
      }
      l[r] = l[r] * alpha + sum;
      m[r] = m_new;
      float* orow = o[r];
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) orow[d] *= alpha;
      const int64_t j_end = std::min(kKeys, visible_hi);
      for (int64_t j = std::max<int64_t>(0, visible_lo); j < j_end; ++j) {
        const float pj = p[j];
        const float* vr = v_rows + (b * kKeys + j) * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) orow[d] += pj * vr[d];
      }
    }
  }
  finish_tile(t, R, row_begin, group, kv_head, strides, head_dim, out, sinks, false);
}

#if defined(__x86_64__)
// The tile functions are templates over the panels' element (float, or Bf16Pair on a bfloat16
// cache), and a pair instantiation inlines vdpbf16ps, so every one of them carries the BF16
// target where the compiler has it: it only permits those instructions, and the float32
// instantiations contain none (the CPU without AVX512-BF16 runs only those).
#if defined(MINIVLLM_HAS_AVX512_BF16)
#define MINIVLLM_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16,fma")))
#else
#define MINIVLLM_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,fma")))
#endif

// Which of a row's keys key0 + j it sees (j: each lane's offset, as floats): j < pos + 1 - key0
// (causal) and, with a window, j >= pos - window + 1 - key0.
struct VisibleKeys {
  __m512 hi, lo;
  MINIVLLM_AVX512 VisibleKeys(int64_t pos, int64_t key0, int64_t window)
      : hi(_mm512_set1_ps(static_cast<float>(pos + 1 - key0))),
        lo(_mm512_set1_ps(static_cast<float>(window > 0 ? pos - window + 1 - key0 : -1))) {}
  MINIVLLM_AVX512 __mmask16 of(__m512 j) const {
    return _mm512_cmp_ps_mask(j, hi, _CMP_LT_OQ) & _mm512_cmp_ps_mask(j, lo, _CMP_GE_OQ);
  }
};

// A row of o scaled by alpha (a rescale: the row's maximum rose).
MINIVLLM_AVX512 inline void scale_row(float* o, float alpha, int64_t head_dim) {
  const __m512 a = _mm512_set1_ps(alpha);
  for (int64_t d = 0; d < head_dim; d += 16) _mm512_store_ps(o + d, _mm512_mul_ps(a, _mm512_load_ps(o + d)));
}

// o[:, d : d + 16 NV] += p[:, :num_keys] . v[:num_keys, d : d + 16 NV], the accumulators in
// registers (NV a constant, so the compiler keeps all R x NV of them there). v: float32 rows
// (ValueRows: 16 a block), or (pairs) rows of pairs of keys (8 a block), whose p are bfloat16
// pairs too: one vdpbf16ps adds two keys' products, 32 multiply-adds where an FMA does 16.
template <int R, int NV, typename E>
MINIVLLM_AVX512 inline void pv_block(TileState<R>& t, const ValueRows<E>& vr, int64_t num_keys, int64_t d) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_load_ps(t.o[r] + d + 16 * c);
  if constexpr (std::is_same_v<E, float>) {
    for (int64_t j0 = 0; j0 < num_keys; j0 += kKeys) {
      const float* rows = vr.blocks[j0 / kKeys] + d;
      const int64_t n = std::min(kKeys, num_keys - j0);
      for (int64_t i = 0; i < n; ++i) {
        __m512 v[NV];
        for (int c = 0; c < NV; ++c) v[c] = _mm512_loadu_ps(rows + i * vr.stride + 16 * c);
        for (int r = 0; r < R; ++r) {
          const __m512 pj = _mm512_set1_ps(t.p[r][j0 + i]);
          for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_fmadd_ps(pj, v[c], acc[r][c]);
        }
      }
    }
  } else {
#if defined(MINIVLLM_HAS_AVX512_BF16)
    // An odd last key pairs with a p of 0 (past every row's last visible key, or a block's padding).
    // The pairs are always the chunk's copy, whose blocks follow one another: one run of rows.
    const Bf16Pair* rows = vr.blocks[0] + d;
    for (int64_t jp = 0; jp < (num_keys + 1) / 2; ++jp) {
      __m512bh v[NV];
      for (int c = 0; c < NV; ++c)
        v[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(rows + jp * vr.stride + 16 * c));
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, t.p_bf16[r] + 2 * jp, sizeof(pair));
        const __m512bh pj = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
        for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pj, v[c]);
      }
    }
#endif
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) _mm512_store_ps(t.o[r] + d + 16 * c, acc[r][c]);
}

// s[:, :NS] = the tile's (scaled) queries . NS panels of 16 keys: per dimension (a pair of
// dimensions on the pair path), NS key vectors and R broadcasts feed R * NS multiply-adds into
// registers (NS a constant, so they stay there).
template <int R, int NS, typename E>
MINIVLLM_AVX512 inline void scores(const TileState<R>& t, const E* panel, int64_t head_dim, __m512 (&s)[R][4]) {
  if constexpr (std::is_same_v<E, float>) {
    for (int64_t d = 0; d < head_dim; ++d) {
      __m512 kd[NS];
      for (int c = 0; c < NS; ++c) kd[c] = _mm512_loadu_ps(panel + (c * head_dim + d) * kKeys);
      for (int r = 0; r < R; ++r) {
        const __m512 qv = _mm512_set1_ps(t.qs[r][d]);
        for (int c = 0; c < NS; ++c) s[r][c] = _mm512_fmadd_ps(qv, kd[c], s[r][c]);
      }
    }
  } else {
#if defined(MINIVLLM_HAS_AVX512_BF16)
    const int64_t num_pairs = head_dim / 2;
    for (int64_t dp = 0; dp < num_pairs; ++dp) {
      __m512bh kd[NS];
      for (int c = 0; c < NS; ++c)
        kd[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(panel + (c * num_pairs + dp) * kKeys));
      for (int r = 0; r < R; ++r) {
        const __m512bh qv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int32_t>(t.q_pairs[r][dp])));
        for (int c = 0; c < NS; ++c) s[r][c] = _mm512_dpbf16_ps(s[r][c], qv, kd[c]);
      }
    }
#endif
  }
}

// Whether every row of the tile sees all 64 keys from key0 (most steps: below the diagonal and
// inside any window).
template <int R>
inline bool is_all_visible(const TileState<R>& t, int64_t key0, int nsub, int64_t window) {
  return nsub == 4 && key0 + 4 * kKeys <= t.pos[0] + 1 && (window <= 0 || key0 >= t.pos[R - 1] - window + 1);
}

// o[:, :] += p . v for the step's num_keys keys, 64 columns of D at a time.
template <int R, typename E>
MINIVLLM_AVX512 inline void add_values(TileState<R>& t, const ValueRows<E>& vr, int64_t num_keys, int64_t head_dim) {
  int64_t d = 0;
  for (; d + 64 <= head_dim; d += 64) pv_block<R, 4>(t, vr, num_keys, d);
  for (; d < head_dim; d += 16) pv_block<R, 1>(t, vr, num_keys, d);
}

// p[r] = 2^(s[r] - m) for the step's 64 keys (zero where `visible` is clear; null: all visible;
// a masked key's score is -inf, whose NaN from exp2_finite_512 the mask clears),
// returned as a lane-wise sum for the row's running l (of the float32 p: the pair path rounds
// only the copy it multiplies into v, as FlashAttention does its bf16 P).
template <int R, typename E>
MINIVLLM_AVX512 inline __m512 store_probabilities(TileState<R>& t, int r, const __m512 (&sr)[4], float m,
                                                  const __mmask16* visible) {
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  __m512 pc[4];
  for (int c = 0; c < 4; ++c) {
    pc[c] = exp2_finite_512(_mm512_sub_ps(sr[c], mv));
    if (visible != nullptr) pc[c] = _mm512_maskz_mov_ps(visible[c], pc[c]);
    if constexpr (std::is_same_v<E, float>) _mm512_store_ps(t.p[r] + c * kKeys, pc[c]);
    sum = _mm512_add_ps(sum, pc[c]);
  }
#if defined(MINIVLLM_HAS_AVX512_BF16)
  if constexpr (!std::is_same_v<E, float>) {  // rounded to nearest even, the low half from the second operand
    _mm512_store_si512(t.p_bf16[r], reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(pc[1], pc[0])));
    _mm512_store_si512(t.p_bf16[r] + 32, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(pc[3], pc[2])));
  }
#endif
  return sum;
}

template <int R, typename E>
MINIVLLM_AVX512 void rescaling_step_avx512(TileState<R>& t, __m512 (&s)[R][4], const ValueRows<E>& vr, int64_t key0,
                                           int nsub, int64_t head_dim, int64_t window, bool is_unmasked);

// A step of 64 keys every row sees (most steps: below the diagonal and inside any window).
// While no score rises more than kRescaleSlack above its row's maximum (after a tile's first
// step, nearly always), the probabilities are taken against the maximum the row already has and
// nothing is rescaled: no maximum across lanes (a chain of shuffles) stands between the scores
// and the values. Otherwise (and on a row's first keys, whose maximum is -inf) the same scores go
// through rescaling_step_avx512. Not inlined: inside the masked step the compiler's register
// allocation made the whole step slower.
template <int R, typename E>
MINIVLLM_AVX512 __attribute__((noinline)) void unmasked_step_avx512(TileState<R>& t, const E* panel,
                                                                    const ValueRows<E>& vr, int64_t key0,
                                                                    int64_t head_dim) {
  __m512 s[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) s[r][c] = _mm512_setzero_ps();
  scores<R, 4>(t, panel, head_dim, s);
  __mmask16 is_over = 0;
  for (int r = 0; r < R; ++r) {
    const __m512 limit = _mm512_set1_ps(t.m[r] + kRescaleSlack);
    for (int c = 0; c < 4; ++c) is_over |= _mm512_cmp_ps_mask(s[r][c], limit, _CMP_GT_OQ);
  }
  if (is_over) {
    rescaling_step_avx512(t, s, vr, key0, 4, head_dim, /*window=*/0, true);  // unmasked: no window test
    return;
  }
  for (int r = 0; r < R; ++r) {
    const __m512 sum = store_probabilities<R, E>(t, r, s[r], t.m[r], nullptr);
    _mm512_store_ps(t.l_lanes[r], _mm512_add_ps(_mm512_load_ps(t.l_lanes[r]), sum));
  }
  add_values(t, vr, 4 * kKeys, head_dim);
}

// The softmax of one step from its scores s (keys [key0, key0 + 16 nsub), nsub <= 4) with every
// row's maximum brought up to date: mask what each row may not see (unless is_unmasked: every
// row sees all 64 keys), the rows' new maxima, their rescale factors in one vector exponential,
// the probabilities and the rescaled outputs; then the weighted values. Rows that see none of
// these keys keep their state.
template <int R, typename E>
MINIVLLM_AVX512 void rescaling_step_avx512(TileState<R>& t, __m512 (&s)[R][4], const ValueRows<E>& vr, int64_t key0,
                                           int nsub, int64_t head_dim, int64_t window, bool is_unmasked) {
  constexpr int kSub = 4;
  const __m512 lane = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  alignas(64) float m_new[16], alpha[16];
  __mmask16 visible[R][kSub];
  bool any = false;
  for (int r = 0; r < R; ++r) {
    __m512 row_max = neg_inf;
    if (is_unmasked) {
      row_max = _mm512_max_ps(_mm512_max_ps(s[r][0], s[r][1]), _mm512_max_ps(s[r][2], s[r][3]));
    } else {
      const VisibleKeys vis(t.pos[r], key0, window);
      for (int c = 0; c < kSub; ++c) {
        const __m512 j = _mm512_add_ps(lane, _mm512_set1_ps(static_cast<float>(c * kKeys)));
        visible[r][c] = c < nsub ? vis.of(j) : 0;
        s[r][c] = _mm512_mask_mov_ps(neg_inf, visible[r][c], s[r][c]);
        row_max = _mm512_max_ps(row_max, s[r][c]);
      }
    }
    m_new[r] = std::max(t.m[r], _mm512_reduce_max_ps(row_max));  // -inf: nothing seen yet
  }
  for (int r = R; r < 16; ++r) m_new[r] = 0.f;
  {
    __m512 m_old = _mm512_set1_ps(0.f);
    for (int r = 0; r < R; ++r) m_old = _mm512_mask_mov_ps(m_old, static_cast<__mmask16>(1u << r), _mm512_set1_ps(t.m[r]));
    // 2^(m_old - m_new): 0 on a row's first keys (m_old = -inf clamps), 1 when the max holds.
    const __m512 diff = _mm512_sub_ps(m_old, _mm512_load_ps(m_new));
    _mm512_store_ps(alpha, exp2_512(_mm512_mask_mov_ps(diff, _mm512_cmp_ps_mask(diff, diff, _CMP_UNORD_Q),
                                                     _mm512_set1_ps(0.f))));
  }
  for (int r = 0; r < R; ++r) {
    if (m_new[r] == -std::numeric_limits<float>::infinity()) {  // no key visible to this row yet
      if constexpr (std::is_same_v<E, float>)
        std::fill(t.p[r], t.p[r] + kSub * kKeys, 0.f);
      else
        std::fill(t.p_bf16[r], t.p_bf16[r] + kSub * kKeys, uint16_t{0});
      continue;
    }
    any = true;
    const __m512 sum = store_probabilities<R, E>(t, r, s[r], m_new[r], is_unmasked ? nullptr : visible[r]);
    // The sum stays in lanes (reduced once, at the tile's end): no horizontal add per step.
    _mm512_store_ps(t.l_lanes[r], _mm512_fmadd_ps(_mm512_set1_ps(alpha[r]), _mm512_load_ps(t.l_lanes[r]), sum));
    t.m[r] = m_new[r];
    if (alpha[r] != 1.f) {
      const __m512 a = _mm512_set1_ps(alpha[r]);
      for (int64_t d = 0; d < head_dim; d += 16) _mm512_store_ps(t.o[r] + d, _mm512_mul_ps(a, _mm512_load_ps(t.o[r] + d)));
    }
  }
  if (any) add_values(t, vr, std::min<int64_t>(nsub * kKeys, t.hi - key0), head_dim);
}

// One step of a tile with AVX-512 intrinsics (head_dim a multiple of 16) on the diagonal, at a
// window's edge or at the context's end: keys [key0, key0 + 16 nsub), nsub <= 4. The scores of R
// rows x 64 keys sit in 4R registers (FMA bound; a row's softmax bookkeeping is paid once per 64
// keys), the weighted values are an [R, 64] x [64, D] product accumulated in registers, 64
// columns of D at a time.
template <int R, typename E>
MINIVLLM_AVX512 void masked_step_avx512(TileState<R>& t, const E* panel, const ValueRows<E>& vr, int64_t key0,
                                        int nsub, int64_t head_dim, int64_t window) {
  __m512 s[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) s[r][c] = _mm512_setzero_ps();
  switch (nsub) {
    case 4: scores<R, 4>(t, panel, head_dim, s); break;
    case 3: scores<R, 3>(t, panel, head_dim, s); break;
    case 2: scores<R, 2>(t, panel, head_dim, s); break;
    default: scores<R, 1>(t, panel, head_dim, s); break;
  }
  rescaling_step_avx512(t, s, vr, key0, nsub, head_dim, window, false);
}

// Tiles [tile_begin, tile_end) of R rows each, together: each 64-key step's K and V (32 KB at
// D = 64 in float32) is loaded into L1 once and serves every tile, where one tile alone would
// stream the whole context from L2 for only R rows of work. Panels and values: a block of 16
// keys is 16 D / kPerElement elements of each.
template <int R, typename E>
MINIVLLM_AVX512 void attend_tiles_avx512(const float* q, int64_t row_begin, int64_t num_tiles, int64_t group,
                                         int64_t kv_head, const RowStrides& strides, int64_t head_dim,
                                         int64_t start_pos, int64_t shared_pos, int64_t first_key, int64_t window,
                                         float scale, const E* k_panels, const ValueRows<E>& values, float* out,
                                         const float* sinks) {
  constexpr int64_t kMaxTiles = 8;
  TORCH_CHECK(num_tiles <= kMaxTiles, "prefill attention: too many tiles");
  TileState<R> tiles[kMaxTiles];
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
  for (int64_t i = 0; i < num_tiles; ++i) {
    // Scores in log2 units (queries scaled by log2 e too), so the softmax's exponentials are
    // powers of 2: exp2_512, four operations fewer than e^x. m and the sums follow; o / l is the same.
    init_tile(tiles[i], R, q, row_begin + i * R, group, kv_head, strides, head_dim, start_pos, shared_pos, first_key,
              window, scale * 1.44269504088896341f, !std::is_same_v<E, float>);
    lo = std::min(lo, tiles[i].lo);
    hi = std::max(hi, tiles[i].hi);
  }
  const int64_t block_elements = head_dim * kKeys / kPerElement<E>;
  const int64_t block_lo = (lo - first_key) / kKeys, block_hi = (hi - first_key + kKeys - 1) / kKeys;
  for (int64_t b = block_lo; b < block_hi; b += 4) {
    const int nsub = static_cast<int>(std::min<int64_t>(4, block_hi - b));
    const int64_t key0 = first_key + b * kKeys;
    for (int64_t i = 0; i < num_tiles; ++i) {
      TileState<R>& t = tiles[i];
      if (key0 >= t.hi || key0 + nsub * kKeys <= t.lo) continue;  // none of these keys visible to the tile
      // Only the panels up to the tile's last visible key (on the diagonal of a causal chunk).
      const int tile_nsub = static_cast<int>(std::min<int64_t>(nsub, (t.hi - key0 + kKeys - 1) / kKeys));
      const E* panel = k_panels + b * block_elements;
      const ValueRows<E> vr{values.blocks + b, values.stride};
      if (is_all_visible(t, key0, tile_nsub, window))
        unmasked_step_avx512(t, panel, vr, key0, head_dim);
      else
        masked_step_avx512(t, panel, vr, key0, tile_nsub, head_dim, window);
    }
  }
  for (int64_t i = 0; i < num_tiles; ++i) {
    for (int r = 0; r < R; ++r) tiles[i].l[r] = _mm512_reduce_add_ps(_mm512_load_ps(tiles[i].l_lanes[r]));
    finish_tile(tiles[i], R, row_begin + i * R, group, kv_head, strides, head_dim, out, sinks, true);
  }
}

// r[j] = element j of every r[i] (a 16 x 16 transpose of 32-bit elements) in registers:
// interleave pairs, then quads (as 64-bit lanes), then 128-bit lanes twice.
MINIVLLM_AVX512 inline void transpose_16x16(__m512 (&r)[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

// gather_block for a full block of 16 keys of a float32 cache (head_dim a multiple of 16): the
// K rows transposed into the panel 16 x 16 at a time in registers, not one strided store per
// element (at a small chunk over a long context, the gather is most of the attention's time).
MINIVLLM_AVX512 void gather_block_avx512(const float* k_cache, const float* v_cache, const int64_t* table,
                                         int64_t block_size, int64_t slot_stride, int64_t head_offset,
                                         int64_t head_dim, int64_t first, float* panel, float* v_rows) {
  const float* k_rows[kKeys];
  for (int64_t i = 0; i < kKeys; ++i) {
    const int64_t t = first + i;
    const int64_t slot = paged_slot(table, block_size, t) * slot_stride + head_offset;
    k_rows[i] = k_cache + slot;
    if (v_rows != nullptr) std::memcpy(v_rows + i * head_dim, v_cache + slot, head_dim * sizeof(float));
  }
  for (int64_t d = 0; d < head_dim; d += 16) {
    __m512 r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(k_rows[i] + d);
    transpose_16x16(r);
    for (int j = 0; j < 16; ++j) _mm512_storeu_ps(panel + (d + j) * kKeys, r[j]);  // element d + j of the 16 keys
  }
}

#if defined(MINIVLLM_HAS_AVX512_BF16)
// 16 bfloat16 values, each zero-extended into a 32-bit lane.
MINIVLLM_AVX512 inline __m512i widen_16(const uint16_t* p) {
  return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Keys [first, first + count) (count <= 16) of a bfloat16 cache as the pair path's operands:
// the panel [D / 2, 16] holds each key's dimension pairs (a row's 32-bit words, transposed 16 x 16
// like a float32 panel), the values [8, D] each pair of keys' two values per dimension. Keys
// past count are zero (their p is 0, and 0 x 0 adds nothing where garbage could be a NaN).
MINIVLLM_AVX512 void gather_block_pairs(const at::BFloat16* k_cache, const at::BFloat16* v_cache,
                                        const int64_t* table, int64_t block_size, int64_t slot_stride,
                                        int64_t head_offset, int64_t head_dim, int64_t first, int64_t count,
                                        Bf16Pair* panel, Bf16Pair* v_pairs) {
  alignas(64) static constexpr uint16_t kZeros[256] = {};  // head_dim <= 256
  const uint16_t* k_rows[kKeys];
  const uint16_t* v_rows[kKeys];
  for (int64_t i = 0; i < kKeys; ++i) {
    if (i >= count) {
      k_rows[i] = v_rows[i] = kZeros;
      continue;
    }
    const int64_t t = first + i;
    const int64_t slot = paged_slot(table, block_size, t) * slot_stride + head_offset;
    k_rows[i] = reinterpret_cast<const uint16_t*>(k_cache + slot);
    v_rows[i] = reinterpret_cast<const uint16_t*>(v_cache + slot);
  }
  const int64_t num_pairs = head_dim / 2;
  for (int64_t dp = 0; dp < num_pairs; dp += 16) {
    const int64_t n = std::min<int64_t>(16, num_pairs - dp);  // 8 at D = 16
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1u);
    __m512 r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(mask, k_rows[i] + 2 * dp));
    transpose_16x16(r);
    for (int j = 0; j < n; ++j) _mm512_storeu_ps(reinterpret_cast<float*>(panel + (dp + j) * kKeys), r[j]);
  }
  for (int64_t jp = 0; jp < kKeys / 2; ++jp) {
    for (int64_t d = 0; d < head_dim; d += 16) {  // key 2 jp in the low half of each element
      const __m512i lo = widen_16(v_rows[2 * jp] + d), hi = widen_16(v_rows[2 * jp + 1] + d);
      _mm512_storeu_si512(v_pairs + jp * head_dim + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}
#endif

// Full tiles of `rows` rows with AVX-512 intrinsics; false when there are none for that many
// rows (then the portable loop runs).
template <typename E>
bool run_tiles_avx512(int64_t rows, const float* q, int64_t row_begin, int64_t num_tiles, int64_t group,
                      int64_t kv_head, const RowStrides& strides, int64_t head_dim, int64_t start_pos,
                      int64_t shared_pos, int64_t first_key, int64_t window, float scale, const E* k_panels,
                      const ValueRows<E>& values, float* out, const float* sinks) {
  if (head_dim % 16 != 0) return false;
#define MINIVLLM_TILE(R)                                                                                         \
  case R:                                                                                                        \
    attend_tiles_avx512<R, E>(q, row_begin, num_tiles, group, kv_head, strides, head_dim, start_pos, shared_pos, \
                              first_key, window, scale, k_panels, values, out, sinks);                           \
    return true;
  switch (rows) {
    MINIVLLM_TILE(1) MINIVLLM_TILE(2) MINIVLLM_TILE(3) MINIVLLM_TILE(4) MINIVLLM_TILE(5) MINIVLLM_TILE(6)
    MINIVLLM_TILE(7) MINIVLLM_TILE(8)
    default: return false;
  }
#undef MINIVLLM_TILE
}

#if defined(MINIVLLM_HAS_AMX)
// The pair path on the AMX tiles (kIsaAmx, head_dim a multiple of 32): both products of a step
// of 64 keys run as tile products, 16 query rows at a time. The K panels [pairs of dimensions,
// 16 keys] are already the B operand of Q K^T, and the value rows [pairs of keys, D] the B
// operand of P V; q and p, rounded to bfloat16 as the pair path rounds them, are the A rows.
// Scores leave the tiles for the same lane-wise softmax (log2 units, the running maximum raised
// only past kRescaleSlack) in AVX-512; o stays in memory and is loaded into the tiles as P V's
// accumulator, so a rescale is a pass over o before the product, and only when a maximum moved.
// (At head_dim 32 and 64, attend_tile_resident below runs instead: o held in the tiles, 32-key
// steps.) A tile's rows need not be whole tokens (16 rows are 5 1/3 tokens of 3 heads): each row keeps its
// position, and rows past the tile's last are zero queries whose results are dropped.
#define MINIVLLM_AMX_ATTN __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma")))

constexpr int64_t kAmxRows = 16;       // query rows a tile: one A tile's rows
constexpr int64_t kAmxTilesPerTask = 4;  // tiles a task: they share each step's K and V in L1 (not resident)

struct AmxTileState {
  alignas(64) uint16_t q[kAmxRows][256];  // scaled queries, bfloat16, zero past the tile's rows
  alignas(64) float o[kAmxRows][256];
  alignas(64) float s[kAmxRows][64];
  alignas(64) uint16_t p[kAmxRows][64];
  alignas(64) float l_lanes[kAmxRows][16];
  int64_t pos[kAmxRows];
  float m[kAmxRows];
  int64_t rows, lo, hi;
};

// Every tile register 16 rows x 64 bytes: A (16 rows x 32 bfloat16), B (16 pairs x 16 columns)
// and C (16 x 16 float32) alike.
MINIVLLM_AMX_ATTN void configure_attention_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  load_tile_config(cfg);
}

MINIVLLM_AMX_ATTN void init_amx_tile(AmxTileState& t, int64_t rows, const float* q, int64_t row_begin, int64_t group,
                                     int64_t kv_head, const RowStrides& strides, int64_t head_dim, int64_t start_pos,
                                     int64_t shared_pos, int64_t first_key, int64_t window, float scale,
                                     bool is_resident) {
  t.rows = rows;
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < kAmxRows; ++r) {
    if (!is_resident) {  // attend_tile_resident starts o, l and m itself
      std::fill(t.o[r], t.o[r] + head_dim, 0.f);
      std::fill(t.l_lanes[r], t.l_lanes[r] + 16, 0.f);
      t.m[r] = -std::numeric_limits<float>::infinity();
    }
    if (r >= rows) {
      std::fill(t.q[r], t.q[r] + head_dim, uint16_t{0});
      t.pos[r] = t.pos[rows - 1];
      continue;
    }
    const int64_t row = row_begin + r, token = row / group, h = kv_head * group + row % group;
    t.pos[r] = shared_pos >= 0 ? shared_pos : start_pos + token;
    const float* qr = q + token * strides.q_token + h * strides.q_head;
    for (int64_t d = 0; d < head_dim; d += 32) {  // rounded to nearest even, as the pair path rounds q
      const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(qr + d), sv), hi = _mm512_mul_ps(_mm512_loadu_ps(qr + d + 16), sv);
      _mm512_store_si512(t.q[r] + d, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
  }
  t.hi = t.pos[rows - 1] + 1;
  t.lo = window > 0 ? std::max<int64_t>(first_key, t.pos[0] - window + 1) : first_key;
}

// One step of a tile: keys [key0, key0 + 16 nsub) (nsub <= 4), their panels at `panel` and value
// pair rows from `v_pairs` (32 keys a chunk, zero-padded past the context), masked unless every
// row sees all 64 keys.
MINIVLLM_AMX_ATTN void amx_step(AmxTileState& t, const Bf16Pair* panel, const Bf16Pair* v_pairs, int64_t key0,
                                int nsub, int64_t head_dim, int64_t window, bool is_unmasked) {
  const int64_t num_pairs = head_dim / 2;
  // S = q K^T: C tiles 0..nsub-1, one per 16 keys, over head_dim in chunks of 32 (16 pairs).
  _tile_zero(0);  // (tile numbers must be constants: no loops over them)
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kc = 0; kc < head_dim / 32; ++kc) {
    _tile_loadd(4, t.q[0] + 32 * kc, sizeof(t.q[0]));
    const Bf16Pair* b = panel + 16 * kc * kKeys;
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (nsub > 1) {
      _tile_loadd(7, b + num_pairs * kKeys, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (nsub > 2) {
      _tile_loadd(6, b + 2 * num_pairs * kKeys, 64);
      _tile_dpbf16ps(2, 4, 6);
    }
    if (nsub > 3) {
      _tile_loadd(7, b + 3 * num_pairs * kKeys, 64);
      _tile_dpbf16ps(3, 4, 7);
    }
  }
  _tile_stored(0, t.s[0], sizeof(t.s[0]));
  _tile_stored(1, t.s[0] + 16, sizeof(t.s[0]));
  _tile_stored(2, t.s[0] + 32, sizeof(t.s[0]));
  _tile_stored(3, t.s[0] + 48, sizeof(t.s[0]));
  const __m512 lane = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t r = 0; r < kAmxRows; ++r) {
    __m512 s[4];
    __mmask16 visible[4] = {0xFFFF, 0xFFFF, 0xFFFF, 0xFFFF};
    for (int c = 0; c < 4; ++c) s[c] = _mm512_load_ps(t.s[r] + 16 * c);
    if (!is_unmasked) {
      const VisibleKeys vis(t.pos[r], key0, window);  // and j < 16 nsub
      for (int c = 0; c < 4; ++c) {
        const __m512 j = _mm512_add_ps(lane, _mm512_set1_ps(static_cast<float>(c * kKeys)));
        visible[c] = c < nsub ? vis.of(j) : 0;
        s[c] = _mm512_mask_mov_ps(neg_inf, visible[c], s[c]);
      }
    }
    float m = t.m[r];
    // One compare of the block's lane-wise maximum, not one a vector: the softmax is bound by
    // the vector units' issue rate, and each operation saved here is one in about 60 a row.
    const __m512 top = _mm512_max_ps(_mm512_max_ps(s[0], s[1]), _mm512_max_ps(s[2], s[3]));
    if (_mm512_cmp_ps_mask(top, _mm512_set1_ps(m + kRescaleSlack), _CMP_GT_OQ)) {
      // a new maximum (a row's first visible keys: m = -inf): rescale what the row holds
      const float m_new = std::max(m, _mm512_reduce_max_ps(top));
      const float alpha = m == -std::numeric_limits<float>::infinity() ? 0.f : std::exp2(m - m_new);
      scale_row(t.l_lanes[r], alpha, 16);
      scale_row(t.o[r], alpha, head_dim);
      t.m[r] = m = m_new;
    }
    if (m == -std::numeric_limits<float>::infinity()) {  // nothing visible to this row yet
      std::fill(t.p[r], t.p[r] + 64, uint16_t{0});
      continue;
    }
    const __m512 mv = _mm512_set1_ps(m);
    __m512 pc[4], sum = _mm512_setzero_ps();
    for (int c = 0; c < 4; ++c) {
      pc[c] = exp2_bf16_512(_mm512_sub_ps(s[c], mv));  // rounded to bfloat16 below
      if (!is_unmasked) pc[c] = _mm512_maskz_mov_ps(visible[c], pc[c]);  // -inf's NaN cleared
      sum = _mm512_add_ps(sum, pc[c]);
    }
    _mm512_store_ps(t.l_lanes[r], _mm512_add_ps(_mm512_load_ps(t.l_lanes[r]), sum));
    _mm512_store_si512(t.p[r], reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(pc[1], pc[0])));
    _mm512_store_si512(t.p[r] + 32, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(pc[3], pc[2])));
  }
  // o += P V: o's rows as the C tiles (4 x 16 columns at a time), 32 keys (16 pairs) a chunk.
  const int64_t num_chunks = (nsub + 1) / 2;
  const int64_t v_stride = head_dim * static_cast<int64_t>(sizeof(Bf16Pair));
  for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
    const int nd = static_cast<int>(std::min<int64_t>(4, (head_dim - d0) / 16));
    constexpr int64_t ldo = sizeof(t.o[0]);
    _tile_loadd(0, t.o[0] + d0, ldo);
    if (nd > 1) _tile_loadd(1, t.o[0] + d0 + 16, ldo);
    if (nd > 2) _tile_loadd(2, t.o[0] + d0 + 32, ldo);
    if (nd > 3) _tile_loadd(3, t.o[0] + d0 + 48, ldo);
    for (int64_t jc = 0; jc < num_chunks; ++jc) {
      _tile_loadd(4, t.p[0] + 32 * jc, sizeof(t.p[0]));
      const Bf16Pair* v = v_pairs + 16 * jc * head_dim + d0;
      _tile_loadd(6, v, v_stride);
      _tile_dpbf16ps(0, 4, 6);
      if (nd > 1) {
        _tile_loadd(7, v + 16, v_stride);
        _tile_dpbf16ps(1, 4, 7);
      }
      if (nd > 2) {
        _tile_loadd(6, v + 32, v_stride);
        _tile_dpbf16ps(2, 4, 6);
      }
      if (nd > 3) {
        _tile_loadd(7, v + 48, v_stride);
        _tile_dpbf16ps(3, 4, 7);
      }
    }
    _tile_stored(0, t.o[0] + d0, ldo);
    if (nd > 1) _tile_stored(1, t.o[0] + d0 + 16, ldo);
    if (nd > 2) _tile_stored(2, t.o[0] + d0 + 32, ldo);
    if (nd > 3) _tile_stored(3, t.o[0] + d0 + 48, ldo);
  }
}

// A tile over all its keys with o held in the tile registers (head_dim D of 32 or 64: o is D / 16
// C tiles), 32 keys a step: S in tiles 4 and 5, A in 6, B in 7. o's load and store around every
// step (amx_step's) was a third of that step's tile time, and it goes. The tile unit and the
// vector units then work on different steps at once: the tile instructions of step j - 1's P V
// and of step j + 1's scores are spread between the rows of step j's softmax, since a tile
// product holds one of the two vector ports for its 16 cycles and, issued in a block, kept the
// softmax's operations waiting behind it (one step's rows are ~370 vector operations, more than
// the core looks ahead). A rescale (a row's maximum passed by more than kRescaleSlack) stores o, scales its rows and loads it back,
// after step j - 1's P V has been issued and before step j's.
constexpr int64_t kStepKeys = 2 * kKeys;  // keys a step of attend_tile_resident: two K panels, one P V chunk

template <int D>
struct ResidentTileOps {  // the tile instructions of one step, by index (tile numbers must be constants)
  static constexpr int kNumPv = 1 + 2 * (D / 16);  // load P, then each 16 columns' V and product
  static constexpr int kNumQk = 1 + (D / 32) * 5;  // zero S, then each 32 dimensions' q, K and products
  static constexpr int kNum = kNumPv + kNumQk;
  const uint16_t* p;      // [16][32] bfloat16 probabilities of step j - 1 (nullptr: no P V this step)
  const Bf16Pair* v;      // its values: 16 pair rows [pairs of keys, D]
  const Bf16Pair* panel;  // step j + 1's K panels, two blocks (nullptr: no scores this step)
  const uint16_t* q;      // [16][256] bfloat16 queries

  MINIVLLM_AMX_ATTN __attribute__((always_inline)) inline void issue(int k) const {
    constexpr int64_t v_stride = D * static_cast<int64_t>(sizeof(Bf16Pair)), block_elements = D * kKeys / 2;
    if (k < kNumPv) {
      if (p == nullptr) return;
      if (k == 0) {
        _tile_loadd(6, p, 64);
        return;
      }
      const int c = (k - 1) / 2;  // o's 16-column tile
      if ((k - 1) % 2 == 0) {
        _tile_loadd(7, v + 16 * c, v_stride);
      } else {
        switch (c) {
          case 0: _tile_dpbf16ps(0, 6, 7); break;
          case 1: _tile_dpbf16ps(1, 6, 7); break;
          case 2: _tile_dpbf16ps(2, 6, 7); break;
          default: _tile_dpbf16ps(3, 6, 7); break;
        }
      }
      return;
    }
    if (panel == nullptr) return;
    k -= kNumPv;
    if (k == 0) {
      _tile_zero(4);
      _tile_zero(5);
      return;
    }
    const int kc = (k - 1) / 5, i = (k - 1) % 5;  // 32 dimensions: q, K of keys 0-15, S0, K of 16-31, S1
    const Bf16Pair* b = panel + 16 * kKeys * kc;
    switch (i) {
      case 0: _tile_loadd(6, q + 32 * kc, 512); break;
      case 1: _tile_loadd(7, b, 64); break;
      case 2: _tile_dpbf16ps(4, 6, 7); break;
      case 3: _tile_loadd(7, b + block_elements, 64); break;
      default: _tile_dpbf16ps(5, 6, 7); break;
    }
  }
};

// o's C tiles (0 to D / 16 - 1, tile c holding o's columns [16 c, 16 c + 16)) zeroed, loaded from
// or stored to o's rows (AmxTileState::o, 1024 bytes apart). The intrinsics paste their tile
// number into the instruction's text, so it must be a literal: a macro, not a template argument.
enum class TileMove { kZero, kLoad, kStore };

template <int D, TileMove kMove>
MINIVLLM_AMX_ATTN void move_o_tiles(float (*o)[256]) {
#define MINIVLLM_MOVE_O_TILE(tile)                                                             \
  if constexpr (kMove == TileMove::kZero) _tile_zero(tile);                                    \
  else if constexpr (kMove == TileMove::kLoad) _tile_loadd(tile, o[0] + 16 * (tile), sizeof(o[0])); \
  else _tile_stored(tile, o[0] + 16 * (tile), sizeof(o[0]));
  MINIVLLM_MOVE_O_TILE(0)
  MINIVLLM_MOVE_O_TILE(1)
  if constexpr (D == 64) {
    MINIVLLM_MOVE_O_TILE(2)
    MINIVLLM_MOVE_O_TILE(3)
  }
#undef MINIVLLM_MOVE_O_TILE
}

// Whether every row of the tile sees keys [key0, key0 + num_keys): its rows' positions rise, so
// the first row's bounds the causal side and the last row's the window's.
inline bool sees_all_keys(const AmxTileState& t, int64_t key0, int64_t num_keys, int64_t window) {
  return key0 + num_keys <= t.pos[0] + 1 && (window <= 0 || key0 >= t.pos[kAmxRows - 1] - window + 1);
}

// Each row's running maximum m, with what its steps read: m + kRescaleSlack (the rescale test)
// and -m, kept beside it so that neither costs an operation a row.
struct RowMaxima {
  float m[kAmxRows], limit[kAmxRows], neg_m[kAmxRows];
  void set(int r, float value) {
    m[r] = value;
    limit[r] = value + kRescaleSlack;
    neg_m[r] = -value;
  }
};

// Step j's softmax over 32 keys from key0 (scores s, probabilities to p), with ops' tile
// instructions spread between its rows. Returns the rows whose maximum rose (alpha: their scale).
template <int D, bool kIsMasked, bool kTracksMax>
MINIVLLM_AMX_ATTN __attribute__((always_inline)) inline uint32_t resident_softmax(
    const AmxTileState& t, const float (*s)[kStepKeys], uint16_t (*p)[kStepKeys], __m512* l, RowMaxima& maxima, float* alpha,
    const ResidentTileOps<D>& ops, int64_t key0, int64_t window) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const __m512 lane = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  uint32_t rescale = 0;
#pragma GCC unroll 16
  for (int r = 0; r < kAmxRows; ++r) {
    __m512 s0 = _mm512_load_ps(s[r]), s1 = _mm512_load_ps(s[r] + 16);
    __mmask16 vis0 = 0xFFFF, vis1 = 0xFFFF;
    if constexpr (kIsMasked) {
      const VisibleKeys vis(t.pos[r], key0, window);
      vis0 = vis.of(lane);
      vis1 = vis.of(_mm512_add_ps(lane, _mm512_set1_ps(16.f)));
      s0 = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), vis0, s0);
      s1 = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), vis1, s1);
    }
    if constexpr (!kTracksMax) {  // p = 2^s: no maximum (attend_tile_resident checks the sums after)
      __m512 p0 = exp2_floor_bf16_512(s0), p1 = exp2_floor_bf16_512(s1);
      if constexpr (kIsMasked) {
        p0 = _mm512_maskz_mov_ps(vis0, p0);
        p1 = _mm512_maskz_mov_ps(vis1, p1);
      }
      l[r] = _mm512_add_ps(l[r], _mm512_add_ps(p0, p1));
      _mm512_store_si512(p[r], reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p1, p0)));
#pragma GCC unroll 8
      for (int k = r * ResidentTileOps<D>::kNum / kAmxRows; k < (r + 1) * ResidentTileOps<D>::kNum / kAmxRows; ++k)
        ops.issue(k);
      continue;
    }
    const __m512 top = _mm512_max_ps(s0, s1);
    if (__builtin_expect(_mm512_cmp_ps_mask(top, _mm512_set1_ps(maxima.limit[r]), _CMP_GT_OQ) != 0, 0)) {
      const float m = maxima.m[r], m_new = std::max(m, _mm512_reduce_max_ps(top));
      maxima.set(r, m_new);
      if (m != kNegInf) {  // a row's first visible keys: its o and l are still zero
        alpha[r] = std::exp2(m - m_new);
        l[r] = _mm512_mul_ps(_mm512_set1_ps(alpha[r]), l[r]);
        rescale |= 1u << r;
      }
    }
    // The broadcasts from memory (limit, neg_m) fold into their operations' operands.
    const __m512 neg_m = _mm512_set1_ps(maxima.neg_m[r]);
    __m512 p0 = exp2_bf16_512(_mm512_add_ps(s0, neg_m)), p1 = exp2_bf16_512(_mm512_add_ps(s1, neg_m));
    if constexpr (kIsMasked) {  // -inf's NaN (and a row with nothing visible yet) cleared
      p0 = _mm512_maskz_mov_ps(maxima.m[r] == kNegInf ? 0 : vis0, p0);
      p1 = _mm512_maskz_mov_ps(maxima.m[r] == kNegInf ? 0 : vis1, p1);
    }
    l[r] = _mm512_add_ps(l[r], _mm512_add_ps(p0, p1));
    _mm512_store_si512(p[r], reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p1, p0)));
#pragma GCC unroll 8
    for (int k = r * ResidentTileOps<D>::kNum / kAmxRows; k < (r + 1) * ResidentTileOps<D>::kNum / kAmxRows; ++k)
      ops.issue(k);
  }
  return rescale;
}

// A row's sum of 2^s within [kMinPlainSum, kMaxPlainSum] and its o finite: its scores, unshifted,
// neither overflowed (2^s past float's range, or o past it) nor lost precision to underflow (each
// score under -126 is then below 2^-66 of the sum). Checked lane-wise, which is stricter: the
// largest of a row's 16 lane sums at least kMinPlainSum, every one at most kMaxPlainSum / 16.
// Outside, the tile runs again with a running maximum. The upper bound is float's range: a
// decoder's attention-sink keys score tens of log2 units above the rest, so a bound of 2^20 would
// send such rows through twice (reasoned from the scores' size, not measured).
constexpr float kMinPlainSum = 0x1p-60f, kMaxPlainSum = 0x1p120f;

// The softmax as p = 2^(s - m), m each row's running maximum (kTracksMax), or as p = 2^s: in log2
// units both give the same p / l up to float rounding (bfloat16 rounds p relative to its size
// either way), and 2^s spares each row the maximum, its test and the shift (about a third of the
// softmax's vector operations: the AMX attention's softmax is bound by their issue rate). Returns
// false when a row's sum left [kMinPlainSum, kMaxPlainSum] or its o is not finite (plain: then
// nothing is kept).
template <int D, bool kTracksMax>
MINIVLLM_AMX_ATTN bool attend_tile_resident(AmxTileState& t, int64_t first_key, const Bf16Pair* k_panels,
                                            const Bf16Pair* v_pairs, int64_t window) {
  constexpr int64_t block_elements = D * kKeys / 2;
  // Scores in one buffer (step j + 1's are stored after every read of step j's); probabilities in
  // two (row 0 of step j is written before step j - 1's P V loads its own).
  alignas(64) float s[kAmxRows][kStepKeys];
  alignas(64) uint16_t p[2][kAmxRows][kStepKeys];
  __m512 l[kAmxRows];
  RowMaxima maxima;
  float alpha[kAmxRows];
  for (int r = 0; r < kAmxRows; ++r) {
    l[r] = _mm512_setzero_ps();
    maxima.set(r, -std::numeric_limits<float>::infinity());
  }
  const int64_t block_lo = (t.lo - first_key) / kKeys, block_hi = (t.hi - first_key + kKeys - 1) / kKeys;
  // At least one step: first_key <= start_pos <= pos[0] and window >= 1 give lo <= pos[0] < hi.
  // The last step may read a block past block_hi: the next head's first (finite, masked) or the
  // zero block after the last head.
  const int64_t num_steps = (block_hi - block_lo + 1) / 2;
  const Bf16Pair* panels = k_panels + block_lo * block_elements;
  const Bf16Pair* values = v_pairs + block_lo * block_elements;
  move_o_tiles<D, TileMove::kZero>(t.o);
  const ResidentTileOps<D> first{nullptr, nullptr, panels, t.q[0]};
  for (int k = 0; k < ResidentTileOps<D>::kNum; ++k) first.issue(k);
  for (int64_t j = 0; j < num_steps; ++j) {
    const int cur = static_cast<int>(j & 1);
    _tile_stored(4, s[0], sizeof(s[0]));
    _tile_stored(5, s[0] + 16, sizeof(s[0]));
    const ResidentTileOps<D> ops{j > 0 ? p[cur ^ 1][0] : nullptr, j > 0 ? values + (j - 1) * 2 * block_elements : nullptr,
                                 j + 1 < num_steps ? panels + (j + 1) * 2 * block_elements : nullptr, t.q[0]};
    const int64_t key0 = first_key + (block_lo + 2 * j) * kKeys;
    const bool is_unmasked = sees_all_keys(t, key0, kStepKeys, window);
    const uint32_t rescale =
        is_unmasked ? resident_softmax<D, false, kTracksMax>(t, s, p[cur], l, maxima, alpha, ops, key0, window)
                    : resident_softmax<D, true, kTracksMax>(t, s, p[cur], l, maxima, alpha, ops, key0, window);
    if (rescale) {  // after step j - 1's P V, before step j's
      move_o_tiles<D, TileMove::kStore>(t.o);
      for (int r = 0; r < kAmxRows; ++r)
        if (rescale >> r & 1) scale_row(t.o[r], alpha[r], D);
      move_o_tiles<D, TileMove::kLoad>(t.o);
    }
  }
  const ResidentTileOps<D> last{p[(num_steps - 1) & 1][0], values + (num_steps - 1) * 2 * block_elements, nullptr,
                                t.q[0]};
  for (int k = 0; k < ResidentTileOps<D>::kNumPv; ++k) last.issue(k);
  move_o_tiles<D, TileMove::kStore>(t.o);
  bool is_in_range = true;
  for (int r = 0; r < kAmxRows; ++r) {
    t.m[r] = kTracksMax ? maxima.m[r] : 0.f;
    _mm512_store_ps(t.l_lanes[r], l[r]);
    if (!kTracksMax && r < t.rows) {  // lanes >= 0: every lane <= max / 16 bounds the sum, one >= min bounds it below
      const __mmask16 high = _mm512_cmp_ps_mask(l[r], _mm512_set1_ps(kMaxPlainSum / 16), _CMP_NLE_UQ);  // or NaN
      const __mmask16 low = _mm512_cmp_ps_mask(l[r], _mm512_set1_ps(kMinPlainSum), _CMP_GE_OQ);
      __mmask16 unbounded = 0;  // o's infinities and NaNs
      for (int d = 0; d < D; d += 16) unbounded |= _mm512_fpclass_ps_mask(_mm512_load_ps(t.o[r] + d), 0x99);
      is_in_range &= high == 0 && low != 0 && unbounded == 0;
    }
  }
  return is_in_range;
}

// Rows of the tile out: o / l, with gpt-oss's sink logit in the denominator (log2 units).
MINIVLLM_AMX_ATTN void finish_amx_tile(const AmxTileState& t, int64_t row_begin, int64_t group, int64_t kv_head,
                                       const RowStrides& strides, int64_t head_dim, float* out, const float* sinks) {
  for (int64_t r = 0; r < t.rows; ++r) {
    const int64_t row = row_begin + r, token = row / group, h = kv_head * group + row % group;
    float* dst = out + token * strides.out_token + h * strides.out_head;
    const float l = _mm512_reduce_add_ps(_mm512_load_ps(t.l_lanes[r]));
    float inv = 1.f / l;
    if (sinks) {
      const float sink = sinks[h] * 1.44269504088896341f;
      const float top = std::max(t.m[r], sink);
      const float keys = std::exp2(t.m[r] - top), rest = std::exp2(sink - top);
      inv = keys / (l * keys + rest);
    }
    const __m512 iv = _mm512_set1_ps(inv);  // head_dim: a multiple of 32 here
    for (int64_t d = 0; d < head_dim; d += 16) _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_load_ps(t.o[r] + d), iv));
  }
}

// Tiles [row_begin + 16 i, ...) of one KV head (num_rows rows left from row_begin), stepping
// through their keys together.
MINIVLLM_AMX_ATTN void attend_tiles_amx(AmxTileState* tiles, const float* q, int64_t row_begin, int64_t num_rows,
                                        int64_t group, int64_t kv_head, const RowStrides& strides, int64_t head_dim,
                                        int64_t start_pos, int64_t shared_pos, int64_t first_key, int64_t window,
                                        float scale, const Bf16Pair* k_panels, const Bf16Pair* v_pairs, float* out,
                                        const float* sinks) {
  const int64_t num_tiles = (num_rows + kAmxRows - 1) / kAmxRows;
  const float log2_scale = scale * 1.44269504088896341f;
  if (head_dim == 32 || head_dim == 64) {  // a tile at a time, through all its keys
    for (int64_t i = 0; i < num_tiles; ++i) {
      init_amx_tile(tiles[0], std::min(kAmxRows, num_rows - i * kAmxRows), q, row_begin + i * kAmxRows, group, kv_head,
                    strides, head_dim, start_pos, shared_pos, first_key, window, log2_scale, true);
      AmxTileState& t = tiles[0];
      const bool is_plain = head_dim == 32 ? attend_tile_resident<32, false>(t, first_key, k_panels, v_pairs, window)
                                           : attend_tile_resident<64, false>(t, first_key, k_panels, v_pairs, window);
      if (!is_plain) {  // a row's scores out of 2^s's range: again, shifted by each row's maximum
        if (head_dim == 32) attend_tile_resident<32, true>(t, first_key, k_panels, v_pairs, window);
        else attend_tile_resident<64, true>(t, first_key, k_panels, v_pairs, window);
      }
      finish_amx_tile(tiles[0], row_begin + i * kAmxRows, group, kv_head, strides, head_dim, out, sinks);
    }
    return;
  }
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
  for (int64_t i = 0; i < num_tiles; ++i) {
    init_amx_tile(tiles[i], std::min(kAmxRows, num_rows - i * kAmxRows), q, row_begin + i * kAmxRows, group, kv_head,
                  strides, head_dim, start_pos, shared_pos, first_key, window, log2_scale, false);
    lo = std::min(lo, tiles[i].lo);
    hi = std::max(hi, tiles[i].hi);
  }
  const int64_t block_elements = head_dim * kKeys / 2;
  const int64_t block_lo = (lo - first_key) / kKeys, block_hi = (hi - first_key + kKeys - 1) / kKeys;
  for (int64_t b = block_lo; b < block_hi; b += 4) {
    const int nsub = static_cast<int>(std::min<int64_t>(4, block_hi - b));
    const int64_t key0 = first_key + b * kKeys;
    for (int64_t i = 0; i < num_tiles; ++i) {
      AmxTileState& t = tiles[i];
      if (key0 >= t.hi || key0 + nsub * kKeys <= t.lo) continue;
      const int tile_nsub = static_cast<int>(std::min<int64_t>(nsub, (t.hi - key0 + kKeys - 1) / kKeys));
      const bool is_unmasked = tile_nsub == 4 && sees_all_keys(t, key0, 4 * kKeys, window);
      amx_step(t, k_panels + b * block_elements, v_pairs + b * block_elements, key0, tile_nsub, head_dim, window,
               is_unmasked);
    }
  }
  for (int64_t i = 0; i < num_tiles; ++i)
    finish_amx_tile(tiles[i], row_begin + i * kAmxRows, group, kv_head, strides, head_dim, out, sinks);
}

MINIVLLM_AMX_ATTN void release_attention_tiles() { _tile_release(); }
#endif  // MINIVLLM_HAS_AMX
#endif  // __x86_64__

// One chunk with panels of E: Bf16Pair on the pair path (a bfloat16 cache, AVX512-BF16: the
// products on vdpbf16ps, q and p rounded to bfloat16), else float (a bfloat16 cache widened).
template <typename E, typename cache_t>
void attend_chunk(const float* q, int64_t num_tokens, int64_t num_heads, const RowStrides& strides,
                  const cache_t* k_cache, const cache_t* v_cache, int64_t num_kv_heads, int64_t head_dim,
                  const int64_t* table, int64_t block_size, int64_t start_pos, float scale, int64_t window,
                  int64_t isa, float* out, const float* sinks, const KeySource& keys = {}) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t slot_stride = keys.slot_stride > 0 ? keys.slot_stride : num_kv_heads * head_dim;
  const int64_t shared_pos = keys.is_bidirectional ? start_pos + num_tokens - 1 : -1;
  const int64_t num_ctx = start_pos + num_tokens;  // keys [0, num_ctx), the chunk's own included
  // With a window, no query sees keys before its first token's window.
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, start_pos - window + 1) : 0;
  const int64_t num_keys = num_ctx - first_key;
  const int64_t num_blocks = (num_keys + kKeys - 1) / kKeys;
  // Per KV head, num_blocks blocks of panels and of values, block_elements each. Not zeroed:
  // every element a tile reads is written below (a partial block's panel is padded with zeros).
  const int64_t block_elements = head_dim * kKeys / kPerElement<E>;
  const int64_t head_elements = num_blocks * block_elements;
  // The AVX-512 tiles read a float32 cache's values in place when each 16-key block lies in one
  // cache block (see the top of this file).
  bool is_values_in_place = false;
  if constexpr (std::is_same_v<E, float> && std::is_same_v<cache_t, float>)
    is_values_in_place = isa >= kIsaAvx512 && head_dim % 16 == 0 && block_size % kKeys == 0 && first_key % kKeys == 0;
  // The AMX tiles multiply P V 32 keys at a time: one more block of values, zero, after the
  // last of the last head (within a head the next head's values follow: finite, their p zero).
  bool is_amx = false;
#if defined(MINIVLLM_HAS_AMX)
  if constexpr (std::is_same_v<E, Bf16Pair>) is_amx = isa >= kIsaAmx && head_dim % 32 == 0;
#endif
  // Both the K panels and the values: the AMX tiles' 32-key steps read a block past the last.
  // 64-byte aligned (scratch_array): a tile's 64-byte rows at new[]'s 16-byte alignment each
  // straddle two cache lines (the last chunk of a 4,000-token prompt, one thread: 4.3 -> 3.6 ms).
  const int64_t num_elements = num_kv_heads * head_elements + (is_amx ? block_elements : 0);
  const Scratch<E> k_panels = scratch_array<E>(num_elements);
  const Scratch<E> v_rows = is_values_in_place ? Scratch<E>() : scratch_array<E>(num_elements);
  if (is_amx) {
    std::fill(k_panels.get() + num_kv_heads * head_elements, k_panels.get() + num_elements, E{0});
    std::fill(v_rows.get() + num_kv_heads * head_elements, v_rows.get() + num_elements, E{0});
  }
  // [KVH, num_blocks]: where each block's value rows start (ValueRows).
  const std::unique_ptr<const E*[]> v_blocks(new const E*[num_kv_heads * num_blocks]);
  at::parallel_for(0, num_kv_heads * num_blocks, 8, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / num_blocks, b = task % num_blocks;
      const int64_t count = std::min(kKeys, num_keys - b * kKeys);
      E* panel = k_panels.get() + h * head_elements + b * block_elements;
      E* rows = is_values_in_place ? nullptr : v_rows.get() + h * head_elements + b * block_elements;
      if constexpr (std::is_same_v<E, float> && std::is_same_v<cache_t, float>) {
        const int64_t slot = paged_slot(table, block_size, first_key + b * kKeys);
        v_blocks[task] = is_values_in_place ? v_cache + slot * slot_stride + h * head_dim : rows;
      } else {
        v_blocks[task] = rows;
      }
      if constexpr (std::is_same_v<E, float>) {
#if defined(__x86_64__)
        if constexpr (std::is_same_v<cache_t, float>) {
          if (isa >= kIsaAvx512 && count == kKeys && head_dim % 16 == 0) {
            gather_block_avx512(k_cache, v_cache, table, block_size, slot_stride, h * head_dim, head_dim,
                                first_key + b * kKeys, panel, rows);
            continue;
          }
        }
#endif
        gather_block(k_cache, v_cache, table, block_size, slot_stride, h * head_dim, head_dim, first_key + b * kKeys,
                     count, panel, rows);
      } else {
#if defined(MINIVLLM_HAS_AVX512_BF16)
        gather_block_pairs(k_cache, v_cache, table, block_size, slot_stride, h * head_dim, head_dim,
                           first_key + b * kKeys, count, panel, rows);
#endif
      }
    }
  });
#if defined(MINIVLLM_HAS_AMX)
  if constexpr (std::is_same_v<E, Bf16Pair>) {
    if (is_amx) {
      // Tasks of up to kAmxTilesPerTask tiles of 16 rows per KV head, head by head, each head's later (longer) first.
      const int64_t num_rows = num_tokens * group, rows_per_task = kAmxRows * kAmxTilesPerTask;
      const int64_t tasks_per_head = (num_rows + rows_per_task - 1) / rows_per_task;
      const int64_t num_tasks = num_kv_heads * tasks_per_head;
      std::atomic<int64_t> next_task{0};
      at::parallel_for(0, std::min<int64_t>(std::max(1, at::get_num_threads()), num_tasks), 1, [&](int64_t, int64_t) {
        const std::unique_ptr<AmxTileState[]> tiles(new AmxTileState[kAmxTilesPerTask]);
        configure_attention_tiles();
        for (int64_t task = next_task++; task < num_tasks; task = next_task++) {
          // Head by head: a head's K and V (1 MiB at 4,000 keys of 64 dimensions) stay in the
          // threads' L2 across its tasks, where cycling through the heads streamed them from L3.
          const int64_t h = task / tasks_per_head, index = tasks_per_head - 1 - task % tasks_per_head;
          const int64_t row_begin = index * rows_per_task;
          attend_tiles_amx(tiles.get(), q, row_begin, std::min(rows_per_task, num_rows - row_begin), group, h, strides,
                           head_dim, start_pos, shared_pos, first_key, window, scale,
                           k_panels.get() + h * head_elements, v_rows.get() + h * head_elements, out, sinks);
        }
        release_attention_tiles();
      });
      return;
    }
  }
#endif
  // Tiles of whole tokens (all `group` heads of each), so a tile's rows share key ranges; a
  // task takes up to kTilesPerTask neighbouring tiles (they share each block of K and V), and
  // the last, partial tile alone.
  constexpr int64_t kTilesPerTask = 8;
  const int64_t tokens_per_tile = std::max<int64_t>(1, kRows / group);
  const int64_t rows_per_tile = tokens_per_tile * group;
  const int64_t num_rows = num_tokens * group;
  const int64_t num_full = num_rows / rows_per_tile, partial_rows = num_rows - num_full * rows_per_tile;
  const int64_t tasks_per_head = (num_full + kTilesPerTask - 1) / kTilesPerTask + (partial_rows ? 1 : 0);
  // Later tiles see more keys: hand them out first, from a shared counter, so the threads
  // finish together.
  const int64_t num_tasks = num_kv_heads * tasks_per_head;
  std::atomic<int64_t> next_task{0};
  at::parallel_for(0, std::min<int64_t>(std::max(1, at::get_num_threads()), num_tasks), 1, [&](int64_t, int64_t) {
    for (int64_t task = next_task++; task < num_tasks; task = next_task++) {
      const int64_t h = task % num_kv_heads, index = tasks_per_head - 1 - task / num_kv_heads;
      const bool is_partial = partial_rows && index == tasks_per_head - 1;
      const int64_t row_begin = is_partial ? num_full * rows_per_tile : index * kTilesPerTask * rows_per_tile;
      const int64_t rows = is_partial ? partial_rows : rows_per_tile;
      const int64_t num_tiles = is_partial ? 1 : std::min(kTilesPerTask, num_full - index * kTilesPerTask);
      const E* kp = k_panels.get() + h * head_elements;
#if defined(__x86_64__)
      const ValueRows<E> values{v_blocks.get() + h * num_blocks, is_values_in_place ? slot_stride : head_dim};
      if (isa >= kIsaAvx512 && run_tiles_avx512(rows, q, row_begin, num_tiles, group, h, strides, head_dim,
                                                start_pos, shared_pos, first_key, window, scale, kp, values, out,
                                                sinks))
        continue;
#endif
      const E* vr = v_rows.get() + h * head_elements;  // not in place: the portable loop runs only where the tiles do not
      if constexpr (std::is_same_v<E, float>) {
        for (int64_t i = 0; i < num_tiles; ++i)
          attend_tile(q, row_begin + i * rows, row_begin + (i + 1) * rows, group, h, strides, head_dim, start_pos,
                      shared_pos, first_key, window, scale, kp, vr, out, sinks);
      }
    }
  });
}

template <typename cache_t>
void chunk_kernel(const float* q, int64_t num_tokens, int64_t num_heads, const RowStrides& strides,
                  const cache_t* k_cache, const cache_t* v_cache, int64_t num_kv_heads, int64_t head_dim,
                  const int64_t* table, int64_t block_size, int64_t start_pos, float scale, int64_t window,
                  int64_t isa, float* out, const float* sinks) {
#if defined(MINIVLLM_HAS_AVX512_BF16)
  if constexpr (std::is_same_v<cache_t, at::BFloat16>) {
    if (isa >= kIsaAvx512Bf16 && head_dim % 16 == 0) {
      attend_chunk<Bf16Pair>(q, num_tokens, num_heads, strides, k_cache, v_cache, num_kv_heads, head_dim, table,
                             block_size, start_pos, scale, window, isa, out, sinks);
      return;
    }
  }
#endif
  attend_chunk<float>(q, num_tokens, num_heads, strides, k_cache, v_cache, num_kv_heads, head_dim, table,
                      block_size, start_pos, scale, window, isa, out, sinks);
}

}  // namespace

void paged_prefill_attention(torch::Tensor q,                            // [n, H, D] float32, D contiguous
                             const torch::Tensor& k_cache,      // [slots, KVH, D]
                             const torch::Tensor& v_cache,      // [slots, KVH, D]
                             const torch::Tensor& block_table,  // [max_blocks] int64
                             int64_t start_pos,                 // cached tokens before the chunk
                             int64_t block_size, double scale, int64_t window, int64_t isa,
                             torch::Tensor out,                 // [n, H, D] float32, D contiguous: written
                             std::optional<torch::Tensor> sinks) {  // [H] float32: each head's sink logit
  TORCH_CHECK(isa <= best_isa(), "paged_prefill_attention: this CPU lacks the requested instruction set");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32, "paged_prefill_attention: q must be float32 [n, H, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_prefill_attention: contiguous caches of one dtype");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt64 && block_table.is_contiguous(),
              "paged_prefill_attention: int64 block table");
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == head_dim && num_heads % num_kv_heads == 0 && head_dim <= 256 &&
              num_heads / num_kv_heads <= kRows, "paged_prefill_attention: head shapes (D <= 256, group <= 8)");
  TORCH_CHECK(block_table.size(0) * block_size >= start_pos + num_tokens, "paged_prefill_attention: block table too short");
  if (q.stride(2) != 1) q = q.contiguous();
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == torch::kFloat32 && out.stride(2) == 1,
              "paged_prefill_attention: out must be float32 [n, H, D], D contiguous");
  const RowStrides strides{q.stride(0), q.stride(1), out.stride(0), out.stride(1)};
  const int64_t* table = block_table.data_ptr<int64_t>();
  const float s = static_cast<float>(scale);
  const float* sink_logits = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == torch::kFloat32 && sinks->is_contiguous() && sinks->numel() == num_heads,
                "paged_prefill_attention: sinks must be float32 [H], contiguous");
    sink_logits = sinks->data_ptr<float>();
  }
  if (k_cache.scalar_type() == torch::kFloat32) {
    chunk_kernel(q.data_ptr<float>(), num_tokens, num_heads, strides, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                 num_kv_heads, head_dim, table, block_size, start_pos, s, window, isa, out.data_ptr<float>(),
                 sink_logits);
  } else {
    TORCH_CHECK(k_cache.scalar_type() == torch::kBFloat16, "paged_prefill_attention: float32 or bfloat16 cache");
    chunk_kernel(q.data_ptr<float>(), num_tokens, num_heads, strides, k_cache.data_ptr<at::BFloat16>(),
                 v_cache.data_ptr<at::BFloat16>(), num_kv_heads, head_dim, table, block_size, start_pos, s, window, isa,
                 out.data_ptr<float>(), sink_logits);
  }
}

#if defined(MINIVLLM_HAS_AVX512_BF16)
// bfloat16 bits to float32, exactly (n a multiple of 16).
static MINIVLLM_AVX512 void widen_bf16_row(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 16)
    _mm512_storeu_si512(dst + i, _mm512_slli_epi32(widen_16(src + i), 16));
}
#endif

// packed_bidirectional_attention hands a step's prompts out whole from this many a thread up.
constexpr int64_t kPromptsPerThread = 2;

// An encoder step's attention (BERT): each prompt's tokens attend to all of that prompt's tokens
// and no other's. q, k and v are read in place from the fused QKV projection's output, rows of
// [q | k | v] (3 H D floats a token), so the step needs no padded batch, no gather of the rows
// into one and no scatter back; each prompt runs as a chunk (the causal kernel's tiles) whose
// keys are its own rows and whose every query sees every key.
// With bf16_products (a bfloat16 model on an AVX512-BF16 CPU), K and V are rounded to bfloat16
// once for the step (or read in place from a bfloat16 qkv) and both products run on the pair
// path's vdpbf16ps tiles (or AMX's), as a bfloat16 cache's chunk does: q and the probabilities
// rounded too, sums in float32.

void packed_bidirectional_attention(const torch::Tensor& qkv,           // [T, 3 H D] float32 (or bfloat16), contiguous
                                    const torch::Tensor& query_starts,  // [B + 1] int64: prompt b's rows
                                    int64_t num_heads, double scale, int64_t isa,
                                    torch::Tensor out,                  // [T, H, D] float32 (bfloat16 with bf16_products), contiguous: written
                                    bool bf16_products) {
  TORCH_CHECK(isa <= best_isa(), "packed_bidirectional_attention: this CPU lacks the requested instruction set");
  const bool is_bf16_qkv = qkv.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(qkv.dim() == 2 && (qkv.scalar_type() == torch::kFloat32 || (is_bf16_qkv && bf16_products)) &&
                  qkv.is_contiguous() && qkv.size(1) % (3 * num_heads) == 0,
              "packed_bidirectional_attention: qkv must be float32 (bfloat16 with bf16_products) [T, 3 H D], contiguous");
  const int64_t num_tokens = qkv.size(0), row = qkv.size(1), head_dim = row / (3 * num_heads);
  TORCH_CHECK(head_dim <= 256, "packed_bidirectional_attention: head_dim <= 256");
  const bool is_bf16_out = out.scalar_type() == torch::kBFloat16;
#if !defined(MINIVLLM_HAS_AMX)
  TORCH_CHECK(!is_bf16_out, "packed_bidirectional_attention: a bfloat16 out needs a build with AMX support");
#endif
  TORCH_CHECK(out.dim() == 3 && out.size(0) == num_tokens && out.size(1) == num_heads && out.size(2) == head_dim &&
                  (out.scalar_type() == torch::kFloat32 || (is_bf16_out && bf16_products)) && out.is_contiguous(),
              "packed_bidirectional_attention: out must be float32 (bfloat16 with bf16_products) [T, H, D], contiguous");
  TORCH_CHECK(query_starts.dim() == 1 && query_starts.scalar_type() == torch::kInt64 && query_starts.is_contiguous() &&
              query_starts.size(0) >= 2, "packed_bidirectional_attention: query_starts must be int64 [B + 1]");
  const int64_t* starts = query_starts.data_ptr<int64_t>();
  const int64_t num_prompts = query_starts.size(0) - 1;
  TORCH_CHECK(starts[0] == 0 && starts[num_prompts] == num_tokens,
              "packed_bidirectional_attention: query_starts must run from 0 to T");
  const int64_t hd = num_heads * head_dim;
  const int64_t identity_table[1] = {0};  // one block of the prompt's length: slot t is row t
  // A bfloat16 out: each prompt's float32 rows rounded into it by the thread that attended them,
  // while they are in its caches (torch's copy of the whole step after it read them back from memory).
  Scratch<float> out_floats = is_bf16_out ? scratch_array<float>(num_tokens * hd) : Scratch<float>();
  float* dst = is_bf16_out ? out_floats.get() : out.data_ptr<float>();
  auto* out_bits = is_bf16_out ? reinterpret_cast<uint16_t*>(out.data_ptr()) : nullptr;
  for (int64_t b = 0; b < num_prompts; ++b)
    TORCH_CHECK(starts[b + 1] >= starts[b], "packed_bidirectional_attention: query_starts must not decrease");
  // Each prompt as a chunk whose keys are its own rows: q at q_base + t * q_row, k at kv + t *
  // kv_row (v hd after it), E the kernel's element (float, or a bfloat16 pair).
  //
  // A step of many prompts (at least kPromptsPerThread a thread) shares them out whole, longest
  // first, from a counter: each prompt's attention then runs on one thread (its parallel parts
  // inline), where one prompt after another, each split over the threads, met at two barriers a
  // prompt (its K/V gather, its tiles) and split short prompts into few tasks.
  const int64_t num_threads = std::max(1, at::get_num_threads());
  const bool is_by_prompt = num_threads > 1 && num_prompts >= kPromptsPerThread * num_threads;
  std::vector<int64_t> order(num_prompts);
  std::iota(order.begin(), order.end(), int64_t{0});
  if (is_by_prompt)
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return starts[a + 1] - starts[a] > starts[b + 1] - starts[b]; });
  std::function<void(int64_t)> widen_q;  // a bfloat16 qkv's q, widened prompt by prompt (below)
  const auto each_prompt = [&](auto element, const float* q_base, int64_t q_row, const auto* kv, int64_t kv_row) {
    using E = decltype(element);
    const KeySource keys{kv_row, true};
    const RowStrides strides{q_row, head_dim, hd, head_dim};
    const auto attend = [&](int64_t b) {
      const int64_t begin = starts[b], len = starts[b + 1] - begin;
      if (len == 0) return;
      if (widen_q) widen_q(b);
      const auto* k = kv + begin * kv_row;
      const int64_t block_size = (len + kKeys - 1) / kKeys * kKeys;
      attend_chunk<E>(q_base + begin * q_row, len, num_heads, strides, k, k + hd, num_heads, head_dim, identity_table,
                      block_size, 0, static_cast<float>(scale), 0, isa, dst + begin * hd, nullptr, keys);
#if defined(MINIVLLM_HAS_AMX)
      if (is_bf16_out && is_by_prompt) round_rows_into_bf16(dst + begin * hd, len, hd, hd, out_bits + begin * hd);
#endif
    };
    if (!is_by_prompt) {
      for (int64_t b = 0; b < num_prompts; ++b) attend(b);
#if defined(MINIVLLM_HAS_AMX)
      if (is_bf16_out)
        at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
          round_rows_into_bf16(dst + begin * hd, end - begin, hd, hd, out_bits + begin * hd);
        });
#endif
      return;
    }
    std::atomic<int64_t> next{0};
    at::parallel_for(0, num_threads, 1, [&](int64_t, int64_t) {
      for (int64_t i = next++; i < num_prompts; i = next++) attend(order[i]);
    });
  };
  if (bf16_products) {
#if defined(MINIVLLM_HAS_AVX512_BF16)
    TORCH_CHECK(isa >= kIsaAvx512Bf16 && head_dim % 16 == 0,
                "packed_bidirectional_attention: bf16_products needs an AVX512-BF16 isa and head_dim a multiple of 16");
    if (is_bf16_qkv) {
      // K and V read in place; q widened to float32 (exactly), which the kernel scales and rounds
      // as it does a float32 q: prompt by prompt on the thread that attends it where prompts go
      // out whole (its rows then still in that core's caches), else in a pass of its own
      const auto* bits = reinterpret_cast<const uint16_t*>(qkv.data_ptr());
      auto q = scratch_array<float>(num_tokens * hd);
      float* qf = q.get();
      const auto widen = [&](int64_t begin, int64_t end) {  // hd: a multiple of 16 here
        for (int64_t t = begin; t < end; ++t) widen_bf16_row(bits + t * row, qf + t * hd, hd);
      };
      if (is_by_prompt) {
        widen_q = [&](int64_t b) { widen(starts[b], starts[b + 1]); };
      } else {
        at::parallel_for(0, num_tokens, 64, widen);
      }
      return each_prompt(Bf16Pair{}, qf, hd, reinterpret_cast<const at::BFloat16*>(bits) + hd, row);
    }
    // [T, k | v] rows of 2 H D (a multiple of 16), rounded by the products' own AVX-512 pass
    const float* base = qkv.data_ptr<float>();
    const auto kv = round_rows_to_bf16(base + hd, num_tokens, row, 2 * hd);
    return each_prompt(Bf16Pair{}, base, row, reinterpret_cast<const at::BFloat16*>(kv.get()), 2 * hd);
#else
    TORCH_CHECK(false, "packed_bidirectional_attention: bf16_products needs a build with AVX512-BF16");
#endif
  }
  const float* base = qkv.data_ptr<float>();
  each_prompt(float{}, base, row, base + hd, row);  // k and v read in place from the fused rows
}

}  // namespace minivllm
