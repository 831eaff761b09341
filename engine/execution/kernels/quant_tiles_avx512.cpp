// The quantized panels' tiles on AVX-512 VNNI (quant_tiles.h has the layout): vpdpbusd multiplies
// 64 unsigned weight codes (16 rows x 4 k) by 4 broadcast int8 activations and adds each row's 4
// products into its int32 lane, so a 32-k block of 16 rows is 8 instructions and no horizontal
// sum. Each block's integer sums become float once, scaled by the row's weight scale times the
// block's activation scale.
//
// 4-bit codes: the low nibbles are masked, the high ones kept in place (16 q), their sums shifted
// down once a block: one instruction a group fewer than shifting every group. MXFP4's nibbles are
// indices: vpshufb looks each up in a 16-byte table (value + 12), so both are masked down to 0..15.
#include "quant_tiles.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include <cstring>

namespace minivllm {
namespace {

#define MINIVLLM_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,f16c,fma")))

// Weights are requested this far ahead of use, into L2.
constexpr int64_t kPrefetchBytes = 1024;

MINIVLLM_VNNI inline __m512 halves16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
MINIVLLM_VNNI inline __m512 ubytes16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
MINIVLLM_VNNI inline __m512i sbytes16(const uint8_t* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
MINIVLLM_VNNI inline __m512i group(const uint8_t* p) { return _mm512_loadu_si512(p); }
// 16 E8M0 bytes -> 2^(e - 128) each (e8m0_half_bits: e - 1 in the exponent field, subnormal below 2).
MINIVLLM_VNNI inline __m512 e8m0_halves16(const uint8_t* p) {
  const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
  const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
  return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2)), normal, tiny));
}
// kMxfp4Values + kMxfp4Offset in each 128-bit lane: vpshufb's table.
MINIVLLM_VNNI inline __m512i mxfp4_table() {
  alignas(16) int8_t t[16];
  for (int i = 0; i < 16; ++i) t[i] = static_cast<int8_t>(kMxfp4Values[i] + kMxfp4Offset);
  return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(t)));
}
// 4 activation bytes in every lane.
MINIVLLM_VNNI inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi32(v);
}

// Row m's integer sums of one 32-k block: lo over the groups' low codes, hi over the high ones
// (as each format defines them).
template <int MT, int64_t T>
MINIVLLM_VNNI inline __attribute__((always_inline)) void block_dots(const uint8_t* c, const int8_t* const* xq, __m512i* lo, __m512i* hi) {
  for (int m = 0; m < MT; ++m) lo[m] = hi[m] = _mm512_setzero_si512();
  if constexpr (T == kQ8_0) {
    for (int t = 0; t < 8; ++t) {
      const __m512i v = group(c + 64 * t);
      for (int m = 0; m < MT; ++m) {
        __m512i& sum = t < 4 ? lo[m] : hi[m];  // two chains
        sum = _mm512_dpbusd_epi32(sum, v, bcast4(xq[m] + 4 * t));
      }
    }
  } else if constexpr (T == kQ6_K) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), top2 = _mm512_set1_epi8(0x30);
    for (int t = 0; t < 4; ++t) {
      const __m512i v = group(c + 64 * t), h = group(c + 256 + 64 * (t / 2));
      // The top 2 bits of this group's low and high codes, moved to bits 4-5 (shifts of 16-bit
      // lanes: the bits that cross a byte land outside the mask).
      const __m512i hl = t % 2 == 0 ? _mm512_slli_epi16(h, 4) : h;
      const __m512i hh = t % 2 == 0 ? _mm512_slli_epi16(h, 2) : _mm512_srli_epi16(h, 2);
      const __m512i ul = _mm512_or_si512(_mm512_and_si512(v, low4), _mm512_and_si512(hl, top2));
      const __m512i uh = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), _mm512_and_si512(hh, top2));
      for (int m = 0; m < MT; ++m) {
        lo[m] = _mm512_dpbusd_epi32(lo[m], ul, bcast4(xq[m] + 4 * t));
        hi[m] = _mm512_dpbusd_epi32(hi[m], uh, bcast4(xq[m] + 16 + 4 * t));
      }
    }
  } else if constexpr (is_5bit(T)) {
    // The top bits of group t's low and high codes are bits t and 4 + t of one group's bytes,
    // moved to bit 4 (16-bit shifts of at most 4: no bit that lands on a byte's bit 4 crossed bytes).
    const __m512i low4 = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x10);
    const __m512i h = group(c + 256);
    for (int t = 0; t < 4; ++t) {
      const __m512i v = group(c + 64 * t);
      const __m512i ul = _mm512_or_si512(_mm512_and_si512(v, low4), _mm512_and_si512(_mm512_slli_epi16(h, 4 - t), top));
      const __m512i uh = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4),
                                         _mm512_and_si512(_mm512_srli_epi16(h, t), top));
      for (int m = 0; m < MT; ++m) {
        lo[m] = _mm512_dpbusd_epi32(lo[m], ul, bcast4(xq[m] + 4 * t));
        hi[m] = _mm512_dpbusd_epi32(hi[m], uh, bcast4(xq[m] + 16 + 4 * t));
      }
    }
  } else if constexpr (T == kMXFP4) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), table = mxfp4_table();
    for (int t = 0; t < 4; ++t) {
      const __m512i v = group(c + 64 * t);
      const __m512i ul = _mm512_shuffle_epi8(table, _mm512_and_si512(v, low4));
      const __m512i uh = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
      for (int m = 0; m < MT; ++m) {
        lo[m] = _mm512_dpbusd_epi32(lo[m], ul, bcast4(xq[m] + 4 * t));
        hi[m] = _mm512_dpbusd_epi32(hi[m], uh, bcast4(xq[m] + 16 + 4 * t));
      }
    }
  } else {  // 4-bit: hi sums 16 q
    const __m512i low4 = _mm512_set1_epi8(0x0F), high4 = _mm512_set1_epi8(static_cast<char>(0xF0));
    for (int t = 0; t < 4; ++t) {
      const __m512i v = group(c + 64 * t);
      const __m512i ul = _mm512_and_si512(v, low4), uh = _mm512_and_si512(v, high4);
      for (int m = 0; m < MT; ++m) {
        lo[m] = _mm512_dpbusd_epi32(lo[m], ul, bcast4(xq[m] + 4 * t));
        hi[m] = _mm512_dpbusd_epi32(hi[m], uh, bcast4(xq[m] + 16 + 4 * t));
      }
    }
  }
}

// Block j of record rec (w: the record): its integer dots with each row's activations into lo /
// hi, the block's lines prefetched ahead. Returns the block's index in the row (its activations').
template <int MT, int64_t T>
MINIVLLM_VNNI inline __attribute__((always_inline)) int64_t record_block_dots(const uint8_t* w, const int8_t* const* xq,
                                                                            int64_t rec, int64_t j, __m512i* lo,
                                                                            __m512i* hi) {
  constexpr QuantFormat f = quant_format(T);
  const uint8_t* c = w + f.header_bytes + j * f.block_bytes;
  for (int64_t line = 0; line < f.block_bytes; line += 64) _mm_prefetch(c + kPrefetchBytes + line, _MM_HINT_T1);
  const int64_t b = rec * f.blocks_per_record + j;
  const int8_t* xk[MT];
  for (int m = 0; m < MT; ++m) xk[m] = xq[m] + 32 * b;
  block_dots<MT, T>(c, xk, lo, hi);
  return b;
}

// One Q4_K / Q5_K super-block of a panel into acc: w = d sc q - dmin mn. A block's integer sum
// times its 6-bit scale stays an integer (< 2^23: exact as a float), so a block costs one
// multiply, one conversion and one FMA by its activation scale, and the minimums one FMA by
// their block's scaled sum; d and dmin multiply the record's two sums once, not each block's.
template <int MT, int64_t T>
MINIVLLM_VNNI inline __attribute__((always_inline)) void sub_block_record(const uint8_t* w, const int8_t* const* xq,
                                                                         const BlockActs* const* xb, int64_t rec,
                                                                         __m512 d, __m512* acc) {
  constexpr QuantFormat f = quant_format(T);
  __m512 acc_scaled[MT], acc_min[MT];
  for (int m = 0; m < MT; ++m) acc_scaled[m] = acc_min[m] = _mm512_setzero_ps();
  for (int64_t j = 0; j < f.blocks_per_record; ++j) {
    __m512i lo[MT], hi[MT];
    const int64_t b = record_block_dots<MT, T>(w, xq, rec, j, lo, hi);
    const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 64 + 16 * j)));
    const __m512 mn = ubytes16(w + 192 + 16 * j);
    for (int m = 0; m < MT; ++m) {
      const BlockActs& x = xb[m][b];
      const __m512i sum = T == kQ4_K ? _mm512_add_epi32(lo[m], _mm512_srai_epi32(hi[m], 4)) : _mm512_add_epi32(lo[m], hi[m]);
      acc_scaled[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_mullo_epi32(sum, sc)), _mm512_set1_ps(x.scale),
                                      acc_scaled[m]);
      acc_min[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(x.scaled_sum), acc_min[m]);
    }
  }
  const __m512 dmin = halves16(w + 32);
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_fnmadd_ps(dmin, acc_min[m], _mm512_fmadd_ps(d, acc_scaled[m], acc[m]));
}

template <int MT, int64_t T>
MINIVLLM_VNNI void tile(const QuantActs& a, int64_t m0, const uint8_t* w, int64_t num_records, float* out) {
  constexpr QuantFormat f = quant_format(T);
  __m512 acc[MT];
  const int8_t* xq[MT];
  const BlockActs* xb[MT];
  for (int m = 0; m < MT; ++m) {
    acc[m] = _mm512_setzero_ps();
    xq[m] = a.q + (m0 + m) * a.K;
    xb[m] = a.blocks + (m0 + m) * a.num_blocks;
  }
  for (int64_t rec = 0; rec < num_records; ++rec, w += f.record_bytes()) {
    const __m512 d = T == kMXFP4 ? e8m0_halves16(w) : halves16(w);
    if constexpr (has_sub_block_min(T)) {
      sub_block_record<MT, T>(w, xq, xb, rec, d, acc);
      continue;
    }
    for (int64_t j = 0; j < f.blocks_per_record; ++j) {
      __m512i lo[MT], hi[MT];
      const int64_t b = record_block_dots<MT, T>(w, xq, rec, j, lo, hi);
      // What the block's rows share: their scale (and minimum) as floats.
      __m512 ds = d, dm = _mm512_setzero_ps();
      __m512i sc_lo = _mm512_setzero_si512(), sc_hi = sc_lo;
      if constexpr (has_block_min(T)) dm = halves16(w + 32);
      if constexpr (T == kQ6_K) {
        sc_lo = sbytes16(w + 32 + 16 * (2 * j));
        sc_hi = sbytes16(w + 32 + 16 * (2 * j + 1));
      }
      for (int m = 0; m < MT; ++m) {
        const BlockActs& x = xb[m][b];
        const __m512 scale = _mm512_mul_ps(ds, _mm512_set1_ps(x.scale));
        __m512i sum;
        if constexpr (T == kQ8_0) {
          sum = _mm512_sub_epi32(_mm512_add_epi32(lo[m], hi[m]), _mm512_set1_epi32(128 * (x.sum_lo + x.sum_hi)));
        } else if constexpr (T == kQ6_K) {
          const __m512i a_lo = _mm512_sub_epi32(lo[m], _mm512_set1_epi32(32 * x.sum_lo));
          const __m512i a_hi = _mm512_sub_epi32(hi[m], _mm512_set1_epi32(32 * x.sum_hi));
          sum = _mm512_add_epi32(_mm512_mullo_epi32(a_lo, sc_lo), _mm512_mullo_epi32(a_hi, sc_hi));
        } else if constexpr (T == kMXFP4) {
          sum = _mm512_sub_epi32(_mm512_add_epi32(lo[m], hi[m]), _mm512_set1_epi32(kMxfp4Offset * (x.sum_lo + x.sum_hi)));
        } else if constexpr (is_5bit(T)) {
          sum = _mm512_add_epi32(lo[m], hi[m]);
          if constexpr (T == kQ5_0) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(16 * (x.sum_lo + x.sum_hi)));
        } else {
          sum = _mm512_add_epi32(lo[m], _mm512_srai_epi32(hi[m], 4));
          if constexpr (T == kQ4_0) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(8 * (x.sum_lo + x.sum_hi)));
        }
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[m]);
        if constexpr (has_block_min(T)) acc[m] = _mm512_fmadd_ps(dm, _mm512_set1_ps(x.scaled_sum), acc[m]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(out + 16 * m, acc[m]);
}

template <int64_t T>
void tile_rows(int64_t rows, const QuantActs& a, int64_t m0, const uint8_t* panel, int64_t num_records, float* acc) {
  switch (rows) {
    case 1: return tile<1, T>(a, m0, panel, num_records, acc);
    case 2: return tile<2, T>(a, m0, panel, num_records, acc);
    case 3: return tile<3, T>(a, m0, panel, num_records, acc);
    default: return tile<4, T>(a, m0, panel, num_records, acc);
  }
}

}  // namespace

__attribute__((target("avx512f,avx512bw"))) void quantize_rows_avx512(const float* x, int64_t M, int64_t K, int64_t ldx,
                                                                      int8_t* q, BlockActs* blocks) {
  const int64_t num_blocks = K / 32;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < num_blocks; ++b) {
      const float* xb = x + m * ldx + 32 * b;
      const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      // cvtps rounds to nearest even (the default MXCSR mode), as nearbyint does
      const __m512i q_lo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), q_hi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
      int8_t* qb = q + m * K + 32 * b;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtsepi32_epi8(q_lo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtsepi32_epi8(q_hi));
      const int32_t sum_lo = _mm512_reduce_add_epi32(q_lo), sum_hi = _mm512_reduce_add_epi32(q_hi);
      const float scale = amax / 127.f;
      blocks[m * num_blocks + b] = {scale, scale * static_cast<float>(sum_lo + sum_hi), sum_lo, sum_hi};
    }
  }
}

void quant_tile_vnni(int64_t type, int64_t rows, const QuantActs& a, int64_t m0, const uint8_t* panel,
                     int64_t num_records, float* acc) {
  with_quant_type(type, [&](auto t) { tile_rows<decltype(t)::value>(rows, a, m0, panel, num_records, acc); });
}

}  // namespace minivllm

#else

namespace minivllm {
void quant_tile_vnni(int64_t type, int64_t rows, const QuantActs& a, int64_t m0, const uint8_t* panel,
                     int64_t num_records, float* acc) {
  quant_tile_scalar(type, rows, a, m0, panel, num_records, acc);  // not reached: quant_gemm.cpp checks the CPU
}
void quantize_rows_avx512(const float* x, int64_t M, int64_t K, int64_t ldx, int8_t* q, BlockActs* blocks) {
  quantize_rows(x, M, K, ldx, q, blocks);  // not reached, as above
}
}  // namespace minivllm

#endif
