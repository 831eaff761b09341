// Decode attention straight from the paged KV cache, for the CPU.
//
// The pure-torch path gathers every sequence's context into a dense [B, L, ...] copy per
// layer and then multiplies; at batch 32 that copying costs more than the attention math.
// Here each sequence walks its block table once: scores of every query head (a KV head
// serves `group` of them, GQA), a softmax, then the weighted sum of V. K and V are read
// once, nothing is materialised, and sequences run in parallel across cores.
//
// With AVX-512 (head sizes a multiple of 16), a KV head's `group` query heads run together in
// registers: each K row meets every query head once, 16 tokens' partial dot products are summed
// horizontally in one transpose-add, the softmax's exponentials run 16 lanes at a time, and the
// weighted sum of V accumulates in registers. A bfloat16 row is widened 32 values at a time into
// its even and odd columns (a shift and a mask), with q put in that order once and the values'
// sums interleaved back at the end (head sizes a multiple of 32; others widen 16 at a time).
// The portable loop (written for the compiler to vectorize) runs elsewhere.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>

#include "simd_exp.h"
#endif

namespace minivllm {
namespace {

#if defined(__x86_64__)
#define MINIVLLM_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,fma")))

MINIVLLM_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
MINIVLLM_AVX512 inline __m512 load16(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// Whether a bfloat16 cache's rows are read 32 values at a time, split into even and odd columns
// (load32_split): head sizes a multiple of 32, up to the 256 a query's split copy holds.
inline bool is_split_width(int64_t head_dim) { return head_dim % 32 == 0 && head_dim <= 256; }

// 32 bfloat16 values (one 64-byte load) as two float32 vectors: the even-indexed values (each
// 32-bit lane's low half, shifted up) and the odd-indexed ones (its high half, masked). Two
// single-cycle operations where load16 takes a cross-lane zero-extension and a shift for every
// 16 values (faster in the kernel alone; in the engine within the runs' spread).
MINIVLLM_AVX512 inline void load32_split(const at::BFloat16* p, __m512& even, __m512& odd) {
  const __m512i raw = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}

// q [G, D] in the order load32_split gives a row: per 32 columns, the 16 even ones, then the 16 odd.
inline void split_columns(const float* q, int64_t rows, int64_t head_dim, float* q_split) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < head_dim; d += 32)
      for (int64_t i = 0; i < 16; ++i) {
        q_split[r * head_dim + d + i] = q[r * head_dim + d + 2 * i];
        q_split[r * head_dim + d + 16 + i] = q[r * head_dim + d + 2 * i + 1];
      }
}

// Rows of the paged cache are scattered (a block of 16 tokens, then a jump) and each is read
// once, so the hardware prefetcher lags: the kernels ask for the row this many tokens ahead,
// into L2 (T1). Into L1 (T0), the requests waited on L1's few miss buffers and the kernel read K
// and V far slower; 12 or 48 rows ahead were no better, NTA no better than T0.
constexpr int64_t kPrefetchRows = 24;

template <typename cache_t>
inline void prefetch_row(const cache_t* row, int64_t count) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < count * static_cast<int64_t>(sizeof(cache_t)); offset += 64)
    _mm_prefetch(p + offset, _MM_HINT_T1);
}

// Lane i = the sum of v[i]'s 16 lanes: pairs, then quads, then 128-bit lanes, adding as it goes.
MINIVLLM_AVX512 inline __m512 sum_lanes16(const __m512 (&v)[16]) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [v0+v2, w0+w2, v1+v3, w1+w3] of v = v[2i], w = v[2i+1]
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: that lane's sum of v[4i .. 4i + 3]
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  __m512 c[2];
  for (int i = 0; i < 2; ++i)  // 128-bit lanes: [b(2i).L0+L1, b(2i).L2+L3, b(2i+1).L0+L1, b(2i+1).L2+L3]
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
}

// The 16 NC values of a row from p as NC float32 vectors: widened 16 at a time (load16), or,
// with kSplit (a bfloat16 row), 32 at a time (load32_split), vectors 2i and 2i + 1 then holding
// the even and the odd columns of the i-th 32.
template <int NC, bool kSplit, typename cache_t>
MINIVLLM_AVX512 inline void load_row(const cache_t* p, __m512 (&r)[NC]) {
  if constexpr (kSplit) {
    static_assert(NC % 2 == 0, "a split row is read 32 values at a time");
    for (int c = 0; c < NC; c += 2) load32_split(p + 16 * c, r[c], r[c + 1]);
  } else {
    for (int c = 0; c < NC; ++c) r[c] = load16(p + 16 * c);
  }
}

// out[g, :] += sum_t p[g, t] v_t[:], columns [c0, c0 + 16 NC) of the G query heads, in registers;
// with kSplit the even and odd columns accumulate apart (load_row) and are interleaved once, at
// the end.
template <int G, int NC, bool kSplit, typename cache_t>
MINIVLLM_AVX512 void weighted_values(const float* probs, int64_t ctx_stride, const cache_t* v, const int64_t* offsets,
                                     int64_t ctx, int64_t c0, const float* inv_sum, int64_t head_dim, float* out) {
  __m512 acc[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < ctx; ++t) {
    // Asked for again, though the scores pass asked for every V row (likely gone from L2 by
    // now at long contexts): without this request the fp32 kernel ran slower there.
    if (t + kPrefetchRows < ctx) prefetch_row(v + offsets[t + kPrefetchRows] + c0, NC * 16);
    __m512 vt[NC];
    load_row<NC, kSplit>(v + offsets[t] + c0, vt);
    for (int g = 0; g < G; ++g) {
      const __m512 pg = _mm512_set1_ps(probs[g * ctx_stride + t]);
      for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_fmadd_ps(pg, vt[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m512 inv = _mm512_set1_ps(inv_sum[g]);
    float* dst = out + g * head_dim + c0;
    if constexpr (kSplit) {
      // Columns 2i and 2i + 1 from lane i of the even and the odd sums: 16 columns, then 16 more.
      const __m512i low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
      const __m512i high = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
      for (int c = 0; c < NC; c += 2) {
        _mm512_storeu_ps(dst + 16 * c, _mm512_mul_ps(_mm512_permutex2var_ps(acc[g][c], low, acc[g][c + 1]), inv));
        _mm512_storeu_ps(dst + 16 * c + 16, _mm512_mul_ps(_mm512_permutex2var_ps(acc[g][c], high, acc[g][c + 1]), inv));
      }
    } else {
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(dst + 16 * c, _mm512_mul_ps(acc[g][c], inv));
    }
  }
}

// Scores of tokens [t0, t0 + 16) (fewer at the context's end) for one KV head's G query heads
// (q: [G, D], unscaled, in split_columns' order with kSplit; k and v point at the head's
// columns) -> scores [G, ctx_stride] at t0.
// Per token and head a 16-lane partial dot product, then one transpose-add turns 16 of them into
// 16 scores.
template <int G, bool kSplit, typename cache_t>
MINIVLLM_AVX512 inline void score_tokens(const float* q, const cache_t* k, const cache_t* v, const int64_t* offsets,
                                         int64_t ctx, int64_t t0, int64_t head_dim, __m512 vscale, int64_t ctx_stride,
                                         float* scores) {
  constexpr int kStep = kSplit ? 2 : 1;  // vectors a load_row
  const int64_t n = std::min<int64_t>(16, ctx - t0), nd = head_dim / 16;
  __m512 partial[G][16];
  for (int64_t j = 0; j < 16; ++j) {
    if (j >= n) {
      for (int g = 0; g < G; ++g) partial[g][j] = _mm512_setzero_ps();
      continue;
    }
    const cache_t* kt = k + offsets[t0 + j];
    // The V row too, so the weighted sum after the softmax starts on rows in L2 and this loop
    // keeps twice the requests in flight.
    if (t0 + j + kPrefetchRows < ctx) {
      prefetch_row(k + offsets[t0 + j + kPrefetchRows], head_dim);
      prefetch_row(v + offsets[t0 + j + kPrefetchRows], head_dim);
    }
    __m512 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t c = 0; c < nd; c += kStep) {
      __m512 kc[kStep];
      load_row<kStep, kSplit>(kt + 16 * c, kc);
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < kStep; ++i)
          acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * head_dim + 16 * (c + i)), kc[i], acc[g]);
    }
    for (int g = 0; g < G; ++g) partial[g][j] = acc[g];
  }
  for (int g = 0; g < G; ++g)
    _mm512_storeu_ps(scores + g * ctx_stride + t0, _mm512_mul_ps(sum_lanes16(partial[g]), vscale));
}

// One KV head's softmax over its G query heads' scores [G, ctx_stride] (overwritten with the
// unnormalised probabilities), then the weighted sum of V (v: the head's columns) -> out [G, D],
// the normalisation folded in. sinks: the G heads' sink logits (in each denominator, with no
// value), or null.
template <int G, bool kSplit, typename cache_t>
MINIVLLM_AVX512 void softmax_values(float* scores, int64_t ctx_stride, const cache_t* v, const int64_t* offsets,
                                    int64_t ctx, int64_t head_dim, float* out, const float* sinks) {
  alignas(64) float inv_sum[G];
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int g = 0; g < G; ++g) {
    float* sg = scores + g * ctx_stride;
    __m512 mx = neg_inf;
    for (int64_t t = 0; t < ctx; t += 16) {
      const __mmask16 m = static_cast<__mmask16>(ctx - t >= 16 ? 0xFFFF : (1u << (ctx - t)) - 1u);
      mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(neg_inf, m, sg + t));
    }
    const float row_max = sinks ? std::max(_mm512_reduce_max_ps(mx), sinks[g]) : _mm512_reduce_max_ps(mx);
    const __m512 vmax = _mm512_set1_ps(row_max);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < ctx; t += 16) {
      const __mmask16 m = static_cast<__mmask16>(ctx - t >= 16 ? 0xFFFF : (1u << (ctx - t)) - 1u);
      const __m512 e = _mm512_maskz_mov_ps(m, exp512(_mm512_sub_ps(_mm512_loadu_ps(sg + t), vmax)));
      _mm512_storeu_ps(sg + t, e);
      sum = _mm512_add_ps(sum, e);
    }
    const float total = _mm512_reduce_add_ps(sum);
    inv_sum[g] = 1.f / (sinks ? total + std::exp(sinks[g] - row_max) : total);
  }
  // 64 columns at a time, then the rest by 16 (by 32 when split: head_dim is a multiple of 32).
  constexpr int kTail = kSplit ? 2 : 1;
  int64_t c0 = 0;
  for (; c0 + 64 <= head_dim; c0 += 64)
    weighted_values<G, 4, kSplit>(scores, ctx_stride, v, offsets, ctx, c0, inv_sum, head_dim, out);
  for (; c0 < head_dim; c0 += 16 * kTail)
    weighted_values<G, kTail, kSplit>(scores, ctx_stride, v, offsets, ctx, c0, inv_sum, head_dim, out);
}

// KV heads [0, num_kv), one pass each over their rows (scratch: G round_up(ctx, 16) scores),
// with q put in split order first when kSplit.
template <int G, bool kSplit, typename cache_t>
MINIVLLM_AVX512 void attend_heads_apart(const float* q, const cache_t* k, const cache_t* v, const int64_t* offsets,
                                        int64_t ctx, int64_t num_kv, int64_t head_dim, __m512 vscale,
                                        int64_t ctx_stride, float* scratch, float* out, const float* sinks) {
  alignas(64) float q_split[kSplit ? 8 * 256 : 1];  // G <= 8, D <= 256 where split (is_split_width)
  for (int64_t h = 0; h < num_kv; ++h) {
    const float* qh = q + h * G * head_dim;
    if constexpr (kSplit) {
      split_columns(qh, G, head_dim, q_split);
      qh = q_split;
    }
    for (int64_t t0 = 0; t0 < ctx; t0 += 16)
      score_tokens<G, kSplit>(qh, k + h * head_dim, v + h * head_dim, offsets, ctx, t0, head_dim, vscale, ctx_stride,
                              scratch);
    softmax_values<G, kSplit>(scratch, ctx_stride, v + h * head_dim, offsets, ctx, head_dim, out + h * G * head_dim,
                              sinks ? sinks + h * G : nullptr);
  }
}

// KV heads [0, num_kv) of one sequence, G query heads each (q: [num_kv, G, D], unscaled), over
// their K and V rows (token t's at k + offsets[t] and v + offsets[t]; head h's columns start
// h D further) -> out [num_kv, G, D]. scratch: num_kv G round_up(ctx, 16) scores. sinks: the
// num_kv G heads' sink logits, or null.
template <int G, typename cache_t>
MINIVLLM_AVX512 void attend_kv_heads_avx512(const float* q, const cache_t* k, const cache_t* v, const int64_t* offsets,
                                            int64_t ctx, int64_t num_kv, int64_t head_dim, float scale, float* scratch,
                                            float* out, const float* sinks) {
  const int64_t ctx_stride = (ctx + 15) / 16 * 16, head_size = G * head_dim;
  const __m512 vscale = _mm512_set1_ps(scale);
  if constexpr (std::is_same_v<cache_t, float>) {
    // Every KV head's scores for 16 tokens before the next 16: a token's row holds all heads
    // side by side, and a pass per head read a third of each row three times over. A bfloat16
    // row is half as long, and there no gain showed, so it keeps a pass per head.
    for (int64_t t0 = 0; t0 < ctx; t0 += 16)
      for (int64_t h = 0; h < num_kv; ++h)
        score_tokens<G, false>(q + h * head_size, k + h * head_dim, v + h * head_dim, offsets, ctx, t0, head_dim,
                               vscale, ctx_stride, scratch + h * G * ctx_stride);
    for (int64_t h = 0; h < num_kv; ++h)
      softmax_values<G, false>(scratch + h * G * ctx_stride, ctx_stride, v + h * head_dim, offsets, ctx, head_dim,
                               out + h * head_size, sinks ? sinks + h * G : nullptr);
  } else if (is_split_width(head_dim)) {
    attend_heads_apart<G, true>(q, k, v, offsets, ctx, num_kv, head_dim, vscale, ctx_stride, scratch, out, sinks);
  } else {
    attend_heads_apart<G, false>(q, k, v, offsets, ctx, num_kv, head_dim, vscale, ctx_stride, scratch, out, sinks);
  }
}

// The AVX-512 path of attend_one (same arguments); false for shapes it does not cover.
template <typename cache_t>
bool attend_one_avx512(const float* qb, const cache_t* kp, const cache_t* vp, const int64_t* table, int64_t first,
                       int64_t ctx, int64_t block_size, float scale, int64_t num_heads, int64_t num_kv_heads,
                       int64_t head_dim, float* ob, std::vector<float>& scratch, int64_t kv_begin, int64_t kv_end,
                       const float* sinks) {
  const int64_t group = num_heads / num_kv_heads, slot_stride = num_kv_heads * head_dim;
  if (head_dim % 16 != 0 || group > 8 || ctx <= 0) return false;
  const int64_t num_kv = kv_end - kv_begin, ctx_stride = (ctx + 15) / 16 * 16;
  if (scratch.size() < static_cast<size_t>(num_kv * group * ctx_stride)) scratch.resize(num_kv * group * ctx_stride);
  // Each token's slot offset (into a K or V cache), once for all KV heads of the call.
  std::vector<int64_t> offsets(ctx);
  for (int64_t t = 0; t < ctx; ++t) {
    offsets[t] = paged_slot(table, block_size, first + t) * slot_stride;
  }
  const float* q = qb + kv_begin * group * head_dim;
  float* o = ob + kv_begin * group * head_dim;
  const cache_t* k = kp + kv_begin * head_dim;
  const cache_t* v = vp + kv_begin * head_dim;
  const float* s = sinks ? sinks + kv_begin * group : nullptr;
  switch (group) {
#define MINIVLLM_GROUP(G)                                                                                  \
  case G:                                                                                                 \
    attend_kv_heads_avx512<G>(q, k, v, offsets.data(), ctx, num_kv, head_dim, scale, scratch.data(), o, s); \
    break;
    MINIVLLM_GROUP(1) MINIVLLM_GROUP(2) MINIVLLM_GROUP(3) MINIVLLM_GROUP(4) MINIVLLM_GROUP(5) MINIVLLM_GROUP(6)
    MINIVLLM_GROUP(7) MINIVLLM_GROUP(8)
#undef MINIVLLM_GROUP
  }
  return true;
}
#endif  // __x86_64__

// One sequence, math in float32 whatever the storage type (float32 or bfloat16): q [H, D] ->
// out [H, D], for the query heads of KV heads [kv_begin, kv_end) (all of them by default).
// scratch holds the scores and one widened cache row. sinks: every query head's sink logit [H]
// (gpt-oss), or null.
template <typename cache_t>
void attend_one(const float* qb, const cache_t* kp, const cache_t* vp, const int64_t* table, int64_t len,
                int64_t block_size, float scale, int64_t window, int64_t num_heads, int64_t num_kv_heads,
                int64_t head_dim, float* ob, std::vector<float>& scratch, int64_t isa, int64_t kv_begin = 0,
                int64_t kv_end = -1, const float* sinks = nullptr) {
  const int64_t group = num_heads / num_kv_heads, slot_stride = num_kv_heads * head_dim;
  if (kv_end < 0) kv_end = num_kv_heads;
  const int64_t h_begin = kv_begin * group, h_end = kv_end * group;
  // A sliding window (window > 0) keeps the last `window` tokens: [first, len).
  const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
  const int64_t ctx = len - first;
#if defined(__x86_64__)
  if (isa >= kIsaAvx512 && attend_one_avx512(qb, kp, vp, table, first, ctx, block_size, scale, num_heads, num_kv_heads,
                                             head_dim, ob, scratch, kv_begin, kv_end, sinks))
    return;
#endif
  scratch.resize(num_heads * ctx + slot_stride);
  float* scores = scratch.data();
  float* row = scores + num_heads * ctx;
  // Token t's K or V row (all KV heads), as float: fp32 is read in place, other storage types
  // are widened into `row`.
  auto load_row = [&](const cache_t* cache, int64_t t) -> const float* {
    const int64_t slot = paged_slot(table, block_size, t);
    const cache_t* src = cache + slot * slot_stride;
    if constexpr (std::is_same_v<cache_t, float>) {
      return src;
    } else {
      for (int64_t i = 0; i < slot_stride; ++i) row[i] = static_cast<float>(src[i]);
      return row;
    }
  };
  for (int64_t t = 0; t < ctx; ++t) {
    const float* kt = load_row(kp, first + t);
    for (int64_t h = h_begin; h < h_end; ++h) {
      const float* qh = qb + h * head_dim;
      const float* kh = kt + (h / group) * head_dim;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < head_dim; ++d) s += qh[d] * kh[d];
      scores[h * ctx + t] = s * scale;
    }
  }
  for (int64_t h = h_begin; h < h_end; ++h) {
    float* sh = scores + h * ctx;
    float mx = sh[0];
    for (int64_t t = 1; t < ctx; ++t) mx = std::max(mx, sh[t]);
    if (sinks) mx = std::max(mx, sinks[h]);
    float sum = sinks ? std::exp(sinks[h] - mx) : 0.f;
    for (int64_t t = 0; t < ctx; ++t) {
      sh[t] = std::exp(sh[t] - mx);
      sum += sh[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < ctx; ++t) sh[t] *= inv;
  }
  std::fill(ob + h_begin * head_dim, ob + h_end * head_dim, 0.f);
  for (int64_t t = 0; t < ctx; ++t) {
    const float* vt = load_row(vp, first + t);
    for (int64_t h = h_begin; h < h_end; ++h) {
      const float p = scores[h * ctx + t];
      const float* vh = vt + (h / group) * head_dim;
      float* oh = ob + h * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) oh[d] += p * vh[d];
    }
  }
}

// One task per sequence: each cached token's K (then V) row of all KV heads is contiguous,
// so it is streamed from memory exactly once.
template <typename scalar_t>
void decode_kernel(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                   const torch::Tensor& block_tables, const torch::Tensor& context_lens, int64_t block_size,
                   double scale, int64_t window, int64_t isa, const float* sinks, torch::Tensor& out) {
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode_attention: contiguous cache");
  const int64_t max_blocks = block_tables.size(1);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t width = num_heads * head_dim;
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch, qf(width), acc(width);
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t i = 0; i < width; ++i) qf[i] = static_cast<float>(qp[b * width + i]);
      attend_one(qf.data(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), bt + b * max_blocks, lens[b],
                 block_size, static_cast<float>(scale), window, num_heads, num_kv_heads, head_dim, acc.data(), scratch,
                 isa, 0, -1, sinks);
      for (int64_t i = 0; i < width; ++i) op[b * width + i] = static_cast<scalar_t>(acc[i]);
    }
  });
}

}  // namespace

KvCacheView KvCacheView::of(const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
              v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type(),
              "attention: K and V caches contiguous [slots, KV heads, D] of one shape and dtype");
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat32 || k_cache.scalar_type() == torch::kBFloat16,
              "attention: float32 or bfloat16 cache only");
  return {k_cache.data_ptr(), v_cache.data_ptr(), k_cache.scalar_type() == torch::kFloat32, k_cache.size(1),
          k_cache.size(2)};
}

void attend_decode_row(const float* q, const KvCacheView& cache, const int64_t* block_table, int64_t context_len,
                       int64_t block_size, float scale, int64_t window, int64_t num_heads, float* out,
                       std::vector<float>& scratch, int64_t kv_begin, int64_t kv_end, int64_t isa,
                       const float* sinks) {
  if (cache.is_fp32) {
    attend_one(q, static_cast<const float*>(cache.k), static_cast<const float*>(cache.v), block_table, context_len,
               block_size, scale, window, num_heads, cache.num_kv_heads, cache.head_dim, out, scratch, isa, kv_begin,
               kv_end, sinks);
  } else {
    attend_one(q, static_cast<const at::BFloat16*>(cache.k), static_cast<const at::BFloat16*>(cache.v), block_table,
               context_len, block_size, scale, window, num_heads, cache.num_kv_heads, cache.head_dim, out, scratch,
               isa, kv_begin, kv_end, sinks);
  }
}

torch::Tensor paged_decode_attention(torch::Tensor q,             // [B, H, D]
                                     torch::Tensor k_cache,       // [slots, KVH, D]
                                     torch::Tensor v_cache,       // [slots, KVH, D]
                                     torch::Tensor block_tables,  // [B, max_blocks] int64
                                     torch::Tensor context_lens,  // [B] int64
                                     int64_t block_size, double scale,
                                     int64_t window,               // 0: none, else the last `window` tokens
                                     int64_t isa,
                                     std::optional<torch::Tensor> sinks) {  // [H] float32: each head's sink logit

  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_decode_attention: q and cache dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && context_lens.scalar_type() == torch::kInt64,
              "paged_decode_attention: int64 block tables and lengths");
  TORCH_CHECK(isa <= best_isa(), "paged_decode_attention: this CPU lacks the requested instruction set");
  q = q.contiguous();
  const float* sink_logits = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == torch::kFloat32 && sinks->is_contiguous() && sinks->numel() == q.size(1),
                "paged_decode_attention: sinks must be float32 [H], contiguous");
    sink_logits = sinks->data_ptr<float>();
  }
  auto out = torch::empty_like(q);
  if (q.scalar_type() == torch::kFloat32) {
    decode_kernel<float>(q, k_cache, v_cache, block_tables, context_lens, block_size, scale, window, isa, sink_logits,
                         out);
  } else if (q.scalar_type() == torch::kBFloat16) {
    decode_kernel<at::BFloat16>(q, k_cache, v_cache, block_tables, context_lens, block_size, scale, window, isa,
                                sink_logits, out);
  } else {
    TORCH_CHECK(false, "paged_decode_attention: float32 or bfloat16 only");
  }
  return out;
}

}  // namespace minivllm
