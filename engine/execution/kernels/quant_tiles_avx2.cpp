// The quantized panels' tiles on AVX2 (quant_tiles.h has the layout), for CPUs without AVX-512
// VNNI: each 64-byte group of 16 rows is two 8-row halves, and a row's products per lane come
// from vpmaddubsw (unsigned codes x int8 activations, pairs summed to int16), added in int16 as
// far as their bound allows (sums_per_widen), then widened to int32 by vpmaddwd. No code is above
// 63 when it meets vpmaddubsw (Q8_0's int8 codes go as |q| against the activations with q's sign,
// llama.cpp's trick, |q| <= 128), so no single result saturates.
// MXFP4's nibbles become their value + 12 (0..24) by a vpshufb table lookup.
// Tiles of up to four rows (two for Q6_K: rows_per_tile); more rows run as several tiles.
#include "quant_tiles.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace minivllm {
namespace {

#define MINIVLLM_AVX2Q __attribute__((target("avx2,fma,f16c")))

constexpr int64_t kPrefetchBytes = 1024;

MINIVLLM_AVX2Q inline __m256 halves8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
MINIVLLM_AVX2Q inline __m256 ubytes8(const uint8_t* p) {
  int64_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v)));
}
MINIVLLM_AVX2Q inline __m256i sbytes8(const uint8_t* p) {
  int64_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_cvtepi8_epi32(_mm_cvtsi64_si128(v));
}
MINIVLLM_AVX2Q inline __m256i half_group(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
MINIVLLM_AVX2Q inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi32(v);
}
// 8 E8M0 bytes -> 2^(e - 128) each (e8m0_half_bits: e - 1 in the exponent field, subnormal below 2).
MINIVLLM_AVX2Q inline __m256 e8m0_halves8(const uint8_t* p) {
  int64_t v;
  std::memcpy(&v, p, sizeof(v));
  const __m256i e = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v));
  const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
  const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
  return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
}
// kMxfp4Values + kMxfp4Offset in each 128-bit lane: vpshufb's table.
MINIVLLM_AVX2Q inline __m256i mxfp4_table() {
  alignas(16) int8_t t[16];
  for (int i = 0; i < 16; ++i) t[i] = static_cast<int8_t>(kMxfp4Values[i] + kMxfp4Offset);
  return _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(t)));
}
// A Q4_K / Q5_K record's 6-bit scales and minimums (quant_tiles.h) as bytes, out 32-byte aligned:
// out[16j + r] row r's scale of sub-block j, out[128 + 16j + r] its minimum (the AVX-512 tile's
// unpack_sub_scales, 32 bytes at a time).
MINIVLLM_AVX2Q inline void unpack_sub_scales(const uint8_t* rec, uint8_t* out) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), top2 = _mm256_set1_epi8(0x30);
  const auto join = [&](__m256i low, __m256i top_at_4) MINIVLLM_AVX2Q {
    return _mm256_or_si256(_mm256_and_si256(low, low4), _mm256_and_si256(top_at_4, top2));
  };
  for (int h = 0; h < 2; ++h) {
    const __m256i low_a = half_group(rec + kSubScaleLowBytes + 32 * h);
    const __m256i low_b = half_group(rec + kSubScaleLowBytes + 64 + 32 * h);
    const __m256i top = half_group(rec + kSubScaleTopBytes + 32 * h);
    const auto store = [&](int at, __m256i v) MINIVLLM_AVX2Q {
      _mm256_store_si256(reinterpret_cast<__m256i*>(out + at + 32 * h), v);
    };
    store(0, join(low_a, _mm256_slli_epi16(top, 4)));
    store(64, join(low_b, top));
    store(128, join(_mm256_srli_epi16(low_a, 4), _mm256_slli_epi16(top, 2)));
    store(192, join(_mm256_srli_epi16(low_b, 4), _mm256_srli_epi16(top, 2)));
  }
}
// The largest operand vpmaddubsw meets for each type (Q8_0's |q| against the signed activations).
constexpr int max_code(int64_t type) {
  if (type == kQ8_0) return 128;
  if (type == kQ6_K) return 63;
  if (type == kMXFP4) return 2 * kMxfp4Offset;
  return is_5bit(type) ? 31 : 15;
}
// vpmaddubsw results an int16 lane may add up before vpmaddwd widens them: each is two products of a
// code and an activation, so 8 (4-bit codes), 4 (5-bit, MXFP4), 2 (Q6_K) or 1 (Q8_0) stay under 2^15.
// The bound takes |x| <= 128, not 127: quantize_rows_avx512 (Skylake-X runs these tiles) gives -128
// for a block with a non-finite or vanishing maximum. A 4-bit row's multiplies a block fall from 16
// (one vpmaddwd a result) to 9.
constexpr int sums_per_widen(int64_t type) {
  const int bound = 32767 / (2 * max_code(type) * 128);
  return bound >= 8 ? 8 : bound >= 4 ? 4 : bound >= 2 ? 2 : 1;
}
static_assert(sums_per_widen(kQ4_0) == 8 && sums_per_widen(kQ5_0) == 4 && sums_per_widen(kMXFP4) == 4 &&
              sums_per_widen(kQ6_K) == 2 && sums_per_widen(kQ8_0) == 1);

MINIVLLM_AVX2Q inline __m256i widen(__m256i pairs) { return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)); }

// Row m's integer sums of one 32-k block for rows 8h .. 8h + 7 of the panel: lo over the low
// codes, hi over the high ones, kept apart only for Q6_K (their scales differ); otherwise lo holds
// both and hi is zero (Q8_0: lo is the whole signed dot product).
template <int MT, int64_t T>
MINIVLLM_AVX2Q inline __attribute__((always_inline)) void block_dots(const uint8_t* c, int h, const int8_t* const* xq, __m256i* lo, __m256i* hi) {
  constexpr int kPerWiden = sums_per_widen(T);
  for (int m = 0; m < MT; ++m) lo[m] = hi[m] = _mm256_setzero_si256();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  if constexpr (T == kQ8_0) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int t = 0; t < 8; ++t) {
      const __m256i q = _mm256_xor_si256(half_group(c + 64 * t + 32 * h), flip);  // the file's int8
      const __m256i mag = _mm256_sign_epi8(q, q);
      for (int m = 0; m < MT; ++m) {
        lo[m] = _mm256_add_epi32(lo[m], widen(_mm256_maddubs_epi16(mag, _mm256_sign_epi8(bcast4(xq[m] + 4 * t), q))));
      }
    }
    return;
  }
  constexpr bool kSplit = T == kQ6_K;
  constexpr int kPerStep = kSplit ? 1 : 2;  // results each t adds to one int16 sum
  static_assert(T == kQ8_0 || (kPerWiden % kPerStep == 0 && 4 * kPerStep % kPerWiden == 0));
  const __m256i top5 = _mm256_set1_epi8(0x10);
  const __m256i hb5 = is_5bit(T) ? half_group(c + 256 + 32 * h) : _mm256_setzero_si256();
  const __m256i table = T == kMXFP4 ? mxfp4_table() : _mm256_setzero_si256();
  __m256i s_lo[MT], s_hi[MT];  // int16 pairs not yet widened
  for (int t = 0; t < 4; ++t) {
    const __m256i v = half_group(c + 64 * t + 32 * h);
    __m256i ul = _mm256_and_si256(v, low4), uh = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    if constexpr (is_5bit(T)) {  // bits t and 4 + t to bit 4 (shifts of at most 4 keep them in their byte)
      ul = _mm256_or_si256(ul, _mm256_and_si256(_mm256_slli_epi16(hb5, 4 - t), top5));
      uh = _mm256_or_si256(uh, _mm256_and_si256(_mm256_srli_epi16(hb5, t), top5));
    }
    if constexpr (T == kMXFP4) {
      ul = _mm256_shuffle_epi8(table, ul);
      uh = _mm256_shuffle_epi8(table, uh);
    }
    if constexpr (T == kQ6_K) {
      const __m256i top2 = _mm256_set1_epi8(0x30), hb = half_group(c + 256 + 64 * (t / 2) + 32 * h);
      const __m256i hl = t % 2 == 0 ? _mm256_slli_epi16(hb, 4) : hb;
      const __m256i hh = t % 2 == 0 ? _mm256_slli_epi16(hb, 2) : _mm256_srli_epi16(hb, 2);
      ul = _mm256_or_si256(ul, _mm256_and_si256(hl, top2));
      uh = _mm256_or_si256(uh, _mm256_and_si256(hh, top2));
    }
    const bool is_first = kPerStep * t % kPerWiden == 0, is_last = kPerStep * (t + 1) % kPerWiden == 0;
    for (int m = 0; m < MT; ++m) {
      const __m256i pl = _mm256_maddubs_epi16(ul, bcast4(xq[m] + 4 * t));
      const __m256i ph = _mm256_maddubs_epi16(uh, bcast4(xq[m] + 16 + 4 * t));
      if constexpr (kSplit) {
        s_lo[m] = is_first ? pl : _mm256_add_epi16(s_lo[m], pl);
        s_hi[m] = is_first ? ph : _mm256_add_epi16(s_hi[m], ph);
      } else {
        const __m256i both = _mm256_add_epi16(pl, ph);
        s_lo[m] = is_first ? both : _mm256_add_epi16(s_lo[m], both);
      }
      if (is_last) {
        lo[m] = _mm256_add_epi32(lo[m], widen(s_lo[m]));
        if constexpr (kSplit) hi[m] = _mm256_add_epi32(hi[m], widen(s_hi[m]));
      }
    }
  }
}

// Rows m0 .. m0 + MT - 1 against NH halves of the panel from half h0 (half h: its rows 8h .. 8h + 7):
// out[16m + 8h + i]. Prefill's tiles take one half at a time, so that 4 rows' sums and accumulators
// fit the 16 registers and each decoded code group serves 4 rows (the panel is read twice, the second
// time from the caches); decode's one or two rows take both halves in one pass over the panel, read
// from memory once.
template <int MT, int NH, int64_t T>
MINIVLLM_AVX2Q void tile(const QuantActs& a, int64_t m0, const uint8_t* w, int64_t num_records, int h0, float* out) {
  constexpr QuantFormat f = quant_format(T);
  __m256 acc[MT][NH];
  const int8_t* xq[MT];
  const BlockActs* xb[MT];
  for (int m = 0; m < MT; ++m) {
    for (int i = 0; i < NH; ++i) acc[m][i] = _mm256_setzero_ps();
    xq[m] = a.q + (m0 + m) * a.K;
    xb[m] = a.blocks + (m0 + m) * a.num_blocks;
  }
  alignas(32) uint8_t scales[256];  // Q4_K, Q5_K: the record's 6-bit scales and minimums as bytes
  for (int64_t rec = 0; rec < num_records; ++rec, w += f.record_bytes()) {
    if constexpr (has_sub_block_min(T)) unpack_sub_scales(w, scales);
    for (int64_t j = 0; j < f.blocks_per_record; ++j) {
      const uint8_t* c = w + f.header_bytes + j * f.block_bytes;
      if (h0 == 0) {
        for (int64_t line = 0; line < f.block_bytes; line += 64) _mm_prefetch(c + kPrefetchBytes + line, _MM_HINT_T1);
      }
      const int64_t b = rec * f.blocks_per_record + j;
      const int8_t* xk[MT];
      for (int m = 0; m < MT; ++m) xk[m] = xq[m] + 32 * b;
      for (int i = 0; i < NH; ++i) {
        const int h = h0 + i;
        __m256i lo[MT], hi[MT];
        block_dots<MT, T>(c, h, xk, lo, hi);
        __m256 ds = T == kMXFP4 ? e8m0_halves8(w + 8 * h) : halves8(w + 16 * h), dm = _mm256_setzero_ps();
        __m256i sc_lo = _mm256_setzero_si256(), sc_hi = sc_lo;
        if constexpr (has_block_min(T)) dm = halves8(w + 32 + 16 * h);
        if constexpr (has_sub_block_min(T)) {
          ds = _mm256_mul_ps(ds, ubytes8(scales + 16 * j + 8 * h));
          dm = _mm256_mul_ps(halves8(w + 32 + 16 * h), ubytes8(scales + 128 + 16 * j + 8 * h));
        }
        if constexpr (T == kQ6_K) {
          sc_lo = sbytes8(w + 32 + 16 * (2 * j) + 8 * h);
          sc_hi = sbytes8(w + 32 + 16 * (2 * j + 1) + 8 * h);
        }
        for (int m = 0; m < MT; ++m) {
          const BlockActs& x = xb[m][b];
          const __m256 scale = _mm256_mul_ps(ds, _mm256_set1_ps(x.scale));
          __m256i sum = lo[m];
          if constexpr (T == kQ4_0) sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(8 * (x.sum_lo + x.sum_hi)));
          if constexpr (T == kQ5_0) sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(16 * (x.sum_lo + x.sum_hi)));
          if constexpr (T == kMXFP4) {
            sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(kMxfp4Offset * (x.sum_lo + x.sum_hi)));
          }
          if constexpr (T == kQ6_K) {
            const __m256i a_lo = _mm256_sub_epi32(lo[m], _mm256_set1_epi32(32 * x.sum_lo));
            const __m256i a_hi = _mm256_sub_epi32(hi[m], _mm256_set1_epi32(32 * x.sum_hi));
            sum = _mm256_add_epi32(_mm256_mullo_epi32(a_lo, sc_lo), _mm256_mullo_epi32(a_hi, sc_hi));
          }
          __m256& o = acc[m][i];
          o = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, o);
          if constexpr (has_block_min(T)) o = _mm256_fmadd_ps(dm, _mm256_set1_ps(x.scaled_sum), o);
          if constexpr (has_sub_block_min(T)) o = _mm256_fnmadd_ps(dm, _mm256_set1_ps(x.scaled_sum), o);
        }
      }
    }
  }
  for (int m = 0; m < MT; ++m) {
    for (int i = 0; i < NH; ++i) _mm256_storeu_ps(out + 16 * m + 8 * (h0 + i), acc[m][i]);
  }
}

// A tile of MT rows: both halves in one pass for one or two rows, else a pass a half.
template <int MT, int64_t T>
void tile_rows_of(const QuantActs& a, int64_t m0, const uint8_t* panel, int64_t num_records, float* out) {
  if constexpr (MT <= 2) {
    tile<MT, 2, T>(a, m0, panel, num_records, 0, out);
  } else {
    for (int h = 0; h < 2; ++h) tile<MT, 1, T>(a, m0, panel, num_records, h, out);
  }
}

// Q6_K keeps each row's low and high sums apart (two int16 and two int32 registers a row): 2 rows.
constexpr int rows_per_tile(int64_t type) { return type == kQ6_K ? 2 : 4; }

template <int64_t T>
void tile_rows(int64_t rows, const QuantActs& a, int64_t m0, const uint8_t* panel, int64_t num_records, float* acc) {
  constexpr int kRows = rows_per_tile(T);
  for (int64_t r = 0; r < rows;) {
    const int64_t n = std::min<int64_t>(kRows, rows - r);
    if (n >= 4) {
      tile_rows_of<kRows >= 4 ? 4 : 1, T>(a, m0 + r, panel, num_records, acc + 16 * r);
    } else if (n == 3) {
      tile_rows_of<kRows >= 3 ? 3 : 1, T>(a, m0 + r, panel, num_records, acc + 16 * r);
    } else if (n == 2) {
      tile_rows_of<2, T>(a, m0 + r, panel, num_records, acc + 16 * r);
    } else {
      tile_rows_of<1, T>(a, m0 + r, panel, num_records, acc + 16 * r);
    }
    r += n;
  }
}

}  // namespace

void quant_tile_avx2(int64_t type, int64_t rows, const QuantActs& a, int64_t m0, const uint8_t* panel,
                     int64_t num_records, float* acc) {
  with_quant_type(type, [&](auto t) { tile_rows<decltype(t)::value>(rows, a, m0, panel, num_records, acc); });
}

}  // namespace minivllm

#else

namespace minivllm {
void quant_tile_avx2(int64_t type, int64_t rows, const QuantActs& a, int64_t m0, const uint8_t* panel,
                     int64_t num_records, float* acc) {
  quant_tile_scalar(type, rows, a, m0, panel, num_records, acc);  // not reached: quant_gemm.cpp checks the CPU
}
}  // namespace minivllm

#endif
