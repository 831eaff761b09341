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
#include <stdexcept>

namespace minivllm {
namespace {

#define MINIVLLM_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,gfni,f16c,fma")))

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
// v in a register: a group that feeds several operations is loaded once (the compiler would fold
// the load into each of them, and the loads, not the arithmetic, then set the pace).
MINIVLLM_VNNI inline __m512i pinned(__m512i v) {
  asm("" : "+v"(v));
  return v;
}
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
// GF2P8AFFINEQB's matrix (row i, for result bit i, is byte 7 - i): bits `bit` and bit + 1 of
// each byte to bits 4 and 5, the others 0.
MINIVLLM_VNNI inline __m512i top_bits_to_4(int bit) {
  return _mm512_set1_epi64(static_cast<int64_t>((uint64_t{1} << bit) << 24 | (uint64_t{2} << bit) << 16));
}
// 4 activation bytes in every lane.
MINIVLLM_VNNI inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi32(v);
}

// A Q4_K / Q5_K record's 6-bit scales and minimums (quant_tiles.h) as bytes, out 64-byte aligned:
// out[16j + r] row r's scale of sub-block j, out[128 + 16j + r] its minimum. Once a record, so its
// blocks read bytes as they would from the record itself. The top bits move to bits 4-5 by one
// affine byte transform each where the CPU has GFNI (G), else by shifts and masks (16-bit shifts:
// the bits that cross a byte land outside the masks).
template <bool G>
MINIVLLM_VNNI inline void unpack_sub_scales(const uint8_t* rec, uint8_t* out) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), top2 = _mm512_set1_epi8(0x30);
  const __m512i low_a = group(rec + kSubScaleLowBytes), low_b = group(rec + kSubScaleLowBytes + 64);
  const __m512i top = group(rec + kSubScaleTopBytes);
  // top's bits `bit` and bit + 1 at bits 4-5, the others 0
  const auto top_at_4 = [&](int bit) MINIVLLM_VNNI {
    if constexpr (G) return _mm512_gf2p8affine_epi64_epi8(top, top_bits_to_4(bit), 0);
    const __m512i moved = bit < 4 ? _mm512_slli_epi16(top, 4 - bit) : _mm512_srli_epi16(top, bit - 4);
    return _mm512_and_si512(moved, top2);
  };
  // (low & 0x0F) | top bits
  const auto join = [&](__m512i low, __m512i top_bits) MINIVLLM_VNNI {
    return _mm512_ternarylogic_epi32(low, top_bits, low4, 0xEC);
  };
  _mm512_store_si512(out, join(low_a, top_at_4(0)));
  _mm512_store_si512(out + 64, join(low_b, G ? top_at_4(4) : _mm512_and_si512(top, top2)));
  _mm512_store_si512(out + 128, join(_mm512_srli_epi16(low_a, 4), top_at_4(2)));
  _mm512_store_si512(out + 192, join(_mm512_srli_epi16(low_b, 4), top_at_4(6)));
}

// Row m's integer sums of one 32-k block of NP panels (codes c[q] of panel q): lo[q * MT + m] over
// the groups' low codes, hi over the high ones (as each format defines them). The panels share
// each broadcast of the activations.
template <int MT, int NP, int64_t T, bool G>
MINIVLLM_VNNI inline __attribute__((always_inline)) void block_dots(const uint8_t* const* c, const int8_t* const* xq,
                                                                   __m512i* lo, __m512i* hi) {
  for (int i = 0; i < NP * MT; ++i) lo[i] = hi[i] = _mm512_setzero_si512();
  // u[q]: panel q's operands for activations x (4 bytes a lane) into sum[q * MT + m].
  const auto dot = [&](const __m512i* u, int64_t k, __m512i* sum) MINIVLLM_VNNI {
    for (int m = 0; m < MT; ++m) {
      const __m512i x = bcast4(xq[m] + k);
      for (int q = 0; q < NP; ++q) sum[q * MT + m] = _mm512_dpbusd_epi32(sum[q * MT + m], u[q], x);
    }
  };
  if constexpr (T == kQ8_0) {
    for (int t = 0; t < 8; ++t) {
      __m512i v[NP];
      for (int q = 0; q < NP; ++q) v[q] = group(c[q] + 64 * t);
      dot(v, 4 * t, t < 4 ? lo : hi);  // two chains
    }
  } else if constexpr (T == kQ6_K) {
    // A code's top 2 bits go to bits 4-5: by one affine byte transform where the CPU has GFNI
    // (bit moves within each byte, no mask needed: half the vector work of a shift and a mask),
    // by a mask where they sit there already. Its low 4 bits join them in one ternary-logic op,
    // (low & 0x0F) | top.
    const __m512i low4 = _mm512_set1_epi8(0x0F), top2 = _mm512_set1_epi8(0x30);
    for (int t = 0; t < 4; ++t) {
      __m512i ul[NP], uh[NP];
      for (int q = 0; q < NP; ++q) {
        const __m512i v = pinned(group(c[q] + 64 * t)), h = pinned(group(c[q] + 256 + 64 * (t / 2)));
        __m512i tl, th;
        if (t % 2 == 1) {
          tl = _mm512_and_si512(h, top2);
          th = _mm512_and_si512(_mm512_srli_epi16(h, 2), top2);
        } else if constexpr (G) {
          tl = _mm512_gf2p8affine_epi64_epi8(h, top_bits_to_4(0), 0);
          th = _mm512_gf2p8affine_epi64_epi8(h, top_bits_to_4(2), 0);
        } else {  // 16-bit shifts: the bits that cross a byte land outside the mask
          tl = _mm512_and_si512(_mm512_slli_epi16(h, 4), top2);
          th = _mm512_and_si512(_mm512_slli_epi16(h, 2), top2);
        }
        ul[q] = _mm512_ternarylogic_epi32(v, tl, low4, 0xEC);  // (v & low4) | tl
        uh[q] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), th, low4, 0xEC);
      }
      dot(ul, 4 * t, lo);
      dot(uh, 16 + 4 * t, hi);
    }
  } else if constexpr (is_5bit(T)) {
    // The top bits of group t's low and high codes are bits t and 4 + t of one group's bytes,
    // moved to bit 4 (16-bit shifts of at most 4: no bit that lands on a byte's bit 4 crossed bytes).
    const __m512i low4 = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x10);
    for (int t = 0; t < 4; ++t) {
      __m512i ul[NP], uh[NP];
      for (int q = 0; q < NP; ++q) {
        const __m512i v = pinned(group(c[q] + 64 * t)), h = pinned(group(c[q] + 256));
        ul[q] = _mm512_or_si512(_mm512_and_si512(v, low4), _mm512_and_si512(_mm512_slli_epi16(h, 4 - t), top));
        uh[q] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4),
                                _mm512_and_si512(_mm512_srli_epi16(h, t), top));
      }
      dot(ul, 4 * t, lo);
      dot(uh, 16 + 4 * t, hi);
    }
  } else if constexpr (T == kMXFP4) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), table = mxfp4_table();
    for (int t = 0; t < 4; ++t) {
      __m512i ul[NP], uh[NP];
      for (int q = 0; q < NP; ++q) {
        const __m512i v = group(c[q] + 64 * t);
        ul[q] = _mm512_shuffle_epi8(table, _mm512_and_si512(v, low4));
        uh[q] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
      }
      dot(ul, 4 * t, lo);
      dot(uh, 16 + 4 * t, hi);
    }
  } else {  // 4-bit: hi sums 16 q
    const __m512i low4 = _mm512_set1_epi8(0x0F), high4 = _mm512_set1_epi8(static_cast<char>(0xF0));
    for (int t = 0; t < 4; ++t) {
      __m512i ul[NP], uh[NP];
      for (int q = 0; q < NP; ++q) {
        const __m512i v = pinned(group(c[q] + 64 * t));
        ul[q] = _mm512_and_si512(v, low4);
        uh[q] = _mm512_and_si512(v, high4);
      }
      dot(ul, 4 * t, lo);
      dot(uh, 16 + 4 * t, hi);
    }
  }
}

// Block j of record rec of NP panels (w[q]: panel q's record): their integer dots with each row's
// activations into lo / hi, the block's lines prefetched ahead. Returns the block's index in the
// row (its activations').
template <int MT, int NP, int64_t T, bool G = false>
MINIVLLM_VNNI inline __attribute__((always_inline)) int64_t record_block_dots(const uint8_t* const* w,
                                                                            const int8_t* const* xq, int64_t rec,
                                                                            int64_t j, __m512i* lo, __m512i* hi) {
  constexpr QuantFormat f = quant_format(T);
  const uint8_t* c[NP];
  for (int q = 0; q < NP; ++q) {
    c[q] = w[q] + f.header_bytes + j * f.block_bytes;
    for (int64_t line = 0; line < f.block_bytes; line += 64) _mm_prefetch(c[q] + kPrefetchBytes + line, _MM_HINT_T1);
  }
  const int64_t b = rec * f.blocks_per_record + j;
  const int8_t* xk[MT];
  for (int m = 0; m < MT; ++m) xk[m] = xq[m] + 32 * b;
  block_dots<MT, NP, T, G>(c, xk, lo, hi);
  return b;
}

// One Q4_K / Q5_K super-block of NP panels into acc: w = d sc q - dmin mn. A block's integer sum
// times its 6-bit scale stays an integer (< 2^23: exact as a float), so a block costs one
// multiply, one conversion and one FMA by its activation scale, and the minimums one FMA by
// their block's scaled sum; d and dmin multiply the record's two sums once, not each block's.
template <int MT, int NP, int64_t T, bool G>
MINIVLLM_VNNI inline __attribute__((always_inline)) void sub_block_record(const uint8_t* const* w,
                                                                         const int8_t* const* xq,
                                                                         const BlockActs* const* xb, int64_t rec,
                                                                         __m512* acc) {
  constexpr QuantFormat f = quant_format(T);
  // d first: the record's first line is then asked for with its first block, not after its last
  // (from memory, a one-row tile that touched it last ran 10-15 % slower).
  __m512 d[NP];
  for (int q = 0; q < NP; ++q) d[q] = halves16(w[q]);
  alignas(64) uint8_t scales[NP][256];
  for (int q = 0; q < NP; ++q) unpack_sub_scales<G>(w[q], scales[q]);
  __m512 acc_scaled[NP * MT], acc_min[NP * MT];
  for (int i = 0; i < NP * MT; ++i) acc_scaled[i] = acc_min[i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < f.blocks_per_record; ++j) {
    __m512i lo[NP * MT], hi[NP * MT];
    const int64_t b = record_block_dots<MT, NP, T>(w, xq, rec, j, lo, hi);
    for (int q = 0; q < NP; ++q) {
      const __m512i sc = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(scales[q] + 16 * j)));
      const __m512 mn = ubytes16(scales[q] + 128 + 16 * j);
      for (int m = 0; m < MT; ++m) {
        const BlockActs& x = xb[m][b];
        const int i = q * MT + m;
        const __m512i sum = T == kQ4_K ? _mm512_add_epi32(lo[i], _mm512_srai_epi32(hi[i], 4)) : _mm512_add_epi32(lo[i], hi[i]);
        acc_scaled[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_mullo_epi32(sum, sc)), _mm512_set1_ps(x.scale),
                                        acc_scaled[i]);
        acc_min[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(x.scaled_sum), acc_min[i]);
      }
    }
  }
  for (int q = 0; q < NP; ++q) {
    const __m512 dmin = halves16(w[q] + 32);
    for (int m = 0; m < MT; ++m) {
      const int i = q * MT + m;
      acc[i] = _mm512_fnmadd_ps(dmin, acc_min[i], _mm512_fmadd_ps(d[q], acc_scaled[i], acc[i]));
    }
  }
}

// One Q6_K super-block of NP panels into acc: w = d sc (q - 32), sc per 16 k. Each half block's
// sum times its scale stays an integer; d multiplies the record's sum once, not each block's.
template <int MT, int NP, bool G>
MINIVLLM_VNNI inline __attribute__((always_inline)) void six_bit_record(const uint8_t* const* w, const int8_t* const* xq,
                                                                       const BlockActs* const* xb, int64_t rec,
                                                                       __m512* acc) {
  constexpr QuantFormat f = quant_format(kQ6_K);
  __m512 d[NP];  // first: see sub_block_record
  for (int q = 0; q < NP; ++q) d[q] = halves16(w[q]);
  __m512 acc_scaled[NP * MT];
  for (int i = 0; i < NP * MT; ++i) acc_scaled[i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < f.blocks_per_record; ++j) {
    __m512i lo[NP * MT], hi[NP * MT];
    const int64_t b = record_block_dots<MT, NP, kQ6_K, G>(w, xq, rec, j, lo, hi);
    for (int q = 0; q < NP; ++q) {
      const __m512i sc_lo = sbytes16(w[q] + 32 + 16 * (2 * j)), sc_hi = sbytes16(w[q] + 32 + 16 * (2 * j + 1));
      for (int m = 0; m < MT; ++m) {
        const BlockActs& x = xb[m][b];
        const int i = q * MT + m;
        const __m512i a_lo = _mm512_sub_epi32(lo[i], _mm512_set1_epi32(32 * x.sum_lo));
        const __m512i a_hi = _mm512_sub_epi32(hi[i], _mm512_set1_epi32(32 * x.sum_hi));
        const __m512i sum = _mm512_add_epi32(_mm512_mullo_epi32(a_lo, sc_lo), _mm512_mullo_epi32(a_hi, sc_hi));
        acc_scaled[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(x.scale), acc_scaled[i]);
      }
    }
  }
  for (int q = 0; q < NP; ++q)
    for (int m = 0; m < MT; ++m) acc[q * MT + m] = _mm512_fmadd_ps(d[q], acc_scaled[q * MT + m], acc[q * MT + m]);
}

// out[q * MT * 16 + m * 16 + n]: row m0 + m's outputs of panel q (NP panels panel_stride bytes apart).
template <int MT, int NP, int64_t T, bool G>
MINIVLLM_VNNI void tile(const QuantActs& a, int64_t m0, const uint8_t* panel, int64_t panel_stride, int64_t num_records,
                        float* out) {
  constexpr QuantFormat f = quant_format(T);
  __m512 acc[NP * MT];
  const int8_t* xq[MT];
  const BlockActs* xb[MT];
  for (int i = 0; i < NP * MT; ++i) acc[i] = _mm512_setzero_ps();
  for (int m = 0; m < MT; ++m) {
    xq[m] = a.q + (m0 + m) * a.K;
    xb[m] = a.blocks + (m0 + m) * a.num_blocks;
  }
  const uint8_t* w[NP];
  for (int q = 0; q < NP; ++q) w[q] = panel + q * panel_stride;
  for (int64_t rec = 0; rec < num_records; ++rec) {
    if constexpr (has_sub_block_min(T)) {
      sub_block_record<MT, NP, T, G>(w, xq, xb, rec, acc);
    } else if constexpr (T == kQ6_K) {
      six_bit_record<MT, NP, G>(w, xq, xb, rec, acc);
    } else {
      __m512 d[NP];
      for (int q = 0; q < NP; ++q) d[q] = T == kMXFP4 ? e8m0_halves16(w[q]) : halves16(w[q]);
      for (int64_t j = 0; j < f.blocks_per_record; ++j) {
        __m512i lo[NP * MT], hi[NP * MT];
        const int64_t b = record_block_dots<MT, NP, T>(w, xq, rec, j, lo, hi);
        for (int q = 0; q < NP; ++q) {
          // What the block's rows share: their scale (and minimum) as floats.
          __m512 dm = _mm512_setzero_ps();
          if constexpr (has_block_min(T)) dm = halves16(w[q] + 32);
          for (int m = 0; m < MT; ++m) {
            const BlockActs& x = xb[m][b];
            const int i = q * MT + m;
            const __m512 scale = _mm512_mul_ps(d[q], _mm512_set1_ps(x.scale));
            __m512i sum;
            if constexpr (T == kQ8_0) {
              sum = _mm512_sub_epi32(_mm512_add_epi32(lo[i], hi[i]), _mm512_set1_epi32(128 * (x.sum_lo + x.sum_hi)));
            } else if constexpr (T == kMXFP4) {
              sum = _mm512_sub_epi32(_mm512_add_epi32(lo[i], hi[i]),
                                     _mm512_set1_epi32(kMxfp4Offset * (x.sum_lo + x.sum_hi)));
            } else if constexpr (is_5bit(T)) {
              sum = _mm512_add_epi32(lo[i], hi[i]);
              if constexpr (T == kQ5_0) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(16 * (x.sum_lo + x.sum_hi)));
            } else {
              sum = _mm512_add_epi32(lo[i], _mm512_srai_epi32(hi[i], 4));
              if constexpr (T == kQ4_0) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(8 * (x.sum_lo + x.sum_hi)));
            }
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[i]);
            if constexpr (has_block_min(T)) acc[i] = _mm512_fmadd_ps(dm, _mm512_set1_ps(x.scaled_sum), acc[i]);
          }
        }
      }
    }
    for (int q = 0; q < NP; ++q) w[q] += f.record_bytes();
  }
  for (int i = 0; i < NP * MT; ++i) _mm512_storeu_ps(out + 16 * i, acc[i]);
}

template <int64_t T, bool G>
void tile_panels(int64_t rows, int64_t num_panels, const QuantActs& a, int64_t m0, const uint8_t* panel,
                 int64_t panel_stride, int64_t num_records, float* acc) {
  if (num_panels == 4 && rows == 1) return tile<1, 4, T, G>(a, m0, panel, panel_stride, num_records, acc);
  if (num_panels == 2 && rows == 1) return tile<1, 2, T, G>(a, m0, panel, panel_stride, num_records, acc);
  if (num_panels == 2 && rows == 2) return tile<2, 2, T, G>(a, m0, panel, panel_stride, num_records, acc);
  for (int64_t q = 0; q < num_panels; ++q, panel += panel_stride, acc += 16 * rows) {
    switch (rows) {
      case 1: tile<1, 1, T, G>(a, m0, panel, 0, num_records, acc); break;
      case 2: tile<2, 1, T, G>(a, m0, panel, 0, num_records, acc); break;
      case 3: tile<3, 1, T, G>(a, m0, panel, 0, num_records, acc); break;
      default: tile<4, 1, T, G>(a, m0, panel, 0, num_records, acc);
    }
  }
}

bool has_gfni() {
  static const bool gfni = __builtin_cpu_supports("gfni");
  return gfni;
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

int64_t quant_tile_panels(int64_t type, int64_t rows) {
  if (rows > 2) return 1;
  return rows == 1 && has_sub_block_min(type) ? 4 : 2;
}

void quant_tile_vnni_unpack(bool gfni, int64_t type, int64_t rows, const QuantActs& a, int64_t m0,
                            const uint8_t* panel, int64_t num_records, float* acc, int64_t num_panels,
                            int64_t panel_stride) {
  if (gfni && !has_gfni()) throw std::runtime_error("quant_tile_vnni_unpack: this CPU lacks GFNI");
  // Only Q6_K's, Q4_K's and Q5_K's tiles read G; the other types' are the same code either way.
  with_quant_type(type, [&](auto t) {
    constexpr int64_t T = decltype(t)::value;
    if (gfni) return tile_panels<T, true>(rows, num_panels, a, m0, panel, panel_stride, num_records, acc);
    tile_panels<T, false>(rows, num_panels, a, m0, panel, panel_stride, num_records, acc);
  });
}

void quant_tile_vnni(int64_t type, int64_t rows, const QuantActs& a, int64_t m0, const uint8_t* panel,
                     int64_t num_records, float* acc, int64_t num_panels, int64_t panel_stride) {
  // GFNI where the CPU has it; a VNNI CPU before Ice Lake (Cascade Lake) moves the bits by shifts
  quant_tile_vnni_unpack(has_gfni(), type, rows, a, m0, panel, num_records, acc, num_panels, panel_stride);
}

}  // namespace minivllm

#else

namespace minivllm {
int64_t quant_tile_panels(int64_t, int64_t) { return 1; }
void quant_tile_vnni(int64_t type, int64_t rows, const QuantActs& a, int64_t m0, const uint8_t* panel,
                     int64_t num_records, float* acc, int64_t num_panels, int64_t panel_stride) {
  for (int64_t p = 0; p < num_panels; ++p)  // not reached: quant_gemm.cpp checks the CPU
    quant_tile_scalar(type, rows, a, m0, panel + p * panel_stride, num_records, acc + p * rows * 16);
}
void quantize_rows_avx512(const float* x, int64_t M, int64_t K, int64_t ldx, int8_t* q, BlockActs* blocks) {
  quantize_rows(x, M, K, ldx, q, blocks);  // not reached, as above
}
void quant_tile_vnni_unpack(bool, int64_t, int64_t, const QuantActs&, int64_t, const uint8_t*, int64_t, float*, int64_t,
                            int64_t) {
  throw std::runtime_error("quant_tile_vnni_unpack: AVX-512 VNNI only");
}
}  // namespace minivllm

#endif
