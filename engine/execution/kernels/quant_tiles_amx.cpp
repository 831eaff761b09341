// The quantized panels' tiles on AMX-INT8, for products of many rows (a prompt's chunk): tdpbssd
// multiplies 16 rows x 32 k of int8 activations by 32 k x 16 outputs of int8 weights into a 16 x 16
// int32 tile in one instruction, 8,192 multiply-adds where vpdpbusd does 64.
//
// The 32-k block types' records, and each 32-k block of a Q4_K or Q5_K super-block
// (quant_tiles.h), already hold their codes as the tile unit reads a B operand: group t, byte
// r * 4 + i is row r's code of k = 4t + i, and a B tile's row t holds output r's k = 4t + i at the
// same byte. So a panel is unpacked once a task, each block's codes to
// 512 signed bytes (the code minus the type's offset: the file's value, not a code the activations'
// sums must correct), and its scales to floats; every 16-row tile of the task's rows then reads
// them from L2.
//
// A block's scales differ from the next block's, so the int32 tile of each block is stored and
// scaled into float32 sums on the vector units, the same operations in the same order as the VNNI
// tile (scale = d * x.scale; acc = fma(float(sum), scale, acc); then + minimum * x.scaled_sum):
// the outputs are the VNNI path's, bit for bit. Block b + 1's tile steps are issued before block b
// is scaled (two sets of tiles, alternating), yet the two barely overlap: a tile store holds up
// the core's other work, and the scaling's two float operations an output a block set the pace
// (bench.amx_peak's int8 rows; docs/benchmarks.md has what else was tried).
#include "amx_tiles.h"
#include "cpu_kernels.h"
#include "quant_tiles.h"

#include <cstring>
#include <vector>

#if defined(MINIVLLM_HAS_AMX)
#include <cpuid.h>

namespace minivllm {
namespace {

#define MINIVLLM_AMX_INT8 __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,f16c,fma")))
#define MINIVLLM_AMX_INT8_INLINE inline __attribute__((always_inline, target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,f16c,fma")))

constexpr int64_t kBlockCodes = 512;  // one 32-k block of 16 outputs, int8

bool cpu_has_amx_int8() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  constexpr unsigned kAmxInt8 = 1u << 25;
  return (edx & kAmxInt8) != 0;
}

constexpr bool has_amx_tile(int64_t type) {
  return type == kQ4_0 || type == kQ4_1 || type == kQ5_0 || type == kQ5_1 || type == kQ8_0 || type == kMXFP4 ||
         has_sub_block_min(type);
}

MINIVLLM_AMX_INT8_INLINE void store_codes(int8_t* out, int64_t row, __m512i v) {
  _mm512_storeu_si512(out + 64 * row, v);
}

// One record (a 32-k block of 16 outputs) -> its 8 tile rows of signed codes.
template <int64_t T>
MINIVLLM_AMX_INT8_INLINE void unpack_codes(const uint8_t* c, int8_t* out) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  if constexpr (T == kQ8_0) {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));  // u - 128 as a byte: the file's int8
    for (int t = 0; t < 8; ++t) store_codes(out, t, _mm512_xor_si512(_mm512_loadu_si512(c + 64 * t), flip));
    return;
  }
  __m512i top = _mm512_setzero_si512();
  if constexpr (is_5bit(T)) top = _mm512_loadu_si512(c + 256);
  const __m512i one = _mm512_set1_epi8(1);
  const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Values)));
  for (int t = 0; t < 4; ++t) {
    const __m512i g = _mm512_loadu_si512(c + 64 * t);
    __m512i half[2] = {_mm512_and_si512(g, low4), _mm512_and_si512(_mm512_srli_epi16(g, 4), low4)};
    for (int h = 0; h < 2; ++h) {
      const int row = 4 * h + t;  // k = 16h + 4t + i
      __m512i v = half[h];
      if constexpr (T == kMXFP4) {
        v = _mm512_shuffle_epi8(table, v);
      } else {
        // 5-bit: the top bit of row `row`'s codes is bit `row` of each top byte
        if constexpr (is_5bit(T)) v = _mm512_or_si512(v, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(top, row), one), 4));
        if constexpr (T == kQ4_0) v = _mm512_sub_epi8(v, _mm512_set1_epi8(8));
        if constexpr (T == kQ5_0) v = _mm512_sub_epi8(v, _mm512_set1_epi8(16));
      }
      store_codes(out, row, v);
    }
  }
}

// Q4_K / Q5_K: each record's d and dmin (scales, mins [num_records, 16]), its 8 blocks' 6-bit
// scales and minimums as floats (sub_scales, sub_mins [num_blocks, 16]: exact), their codes as
// Q4_1's / Q5_1's (unsigned, no offset).
template <int64_t T>
MINIVLLM_AMX_INT8 void unpack_k_panel(const uint8_t* panel, int64_t num_records, int8_t* codes, float* scales,
                                      float* mins, float* sub_scales, float* sub_mins) {
  constexpr QuantFormat f = quant_format(T);
  constexpr int64_t kCodes = T == kQ4_K ? kQ4_1 : kQ5_1;
  for (int64_t rec = 0; rec < num_records; ++rec, panel += f.record_bytes()) {
    _mm512_storeu_ps(scales + 16 * rec, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel))));
    _mm512_storeu_ps(mins + 16 * rec, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + 32))));
    for (int64_t j = 0; j < f.blocks_per_record; ++j) {
      const int64_t b = rec * f.blocks_per_record + j;
      for (int64_t r = 0; r < 16; ++r) {
        sub_scales[16 * b + r] = static_cast<float>(sub_block_scale(panel, j, r, false));
        sub_mins[16 * b + r] = static_cast<float>(sub_block_scale(panel, j, r, true));
      }
      unpack_codes<kCodes>(panel + f.header_bytes + j * f.block_bytes, codes + kBlockCodes * b);
    }
  }
}

template <int64_t T>
MINIVLLM_AMX_INT8 void unpack_panel(const uint8_t* panel, int64_t num_records, int8_t* codes, float* scales,
                                    float* mins) {
  constexpr QuantFormat f = quant_format(T);
  for (int64_t b = 0; b < num_records; ++b, panel += f.record_bytes()) {
    if constexpr (T == kMXFP4) {
      for (int r = 0; r < 16; ++r) {
        const uint32_t bits = e8m0_half_bits(panel[r]);
        std::memcpy(scales + 16 * b + r, &bits, sizeof(bits));
      }
    } else {
      _mm512_storeu_ps(scales + 16 * b, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel))));
    }
    if constexpr (has_block_min(T))
      _mm512_storeu_ps(mins + 16 * b, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + 32))));
    unpack_codes<T>(panel + f.header_bytes, codes + kBlockCodes * b);
  }
}

// Tiles: C0 = tmm0, A0 = tmm2, B0 = tmm3 for even blocks; C1 = tmm1, A1 = tmm4, B1 = tmm5 for odd.
MINIVLLM_AMX_INT8 void configure_quant_tiles() {
  TileConfig cfg;
  for (int t : {0, 1}) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  for (int t : {2, 4}) {  // 16 rows x 32 k of int8 activations
    cfg.rows[t] = 16;
    cfg.colsb[t] = 32;
  }
  for (int t : {3, 5}) {  // 8 quads of k x 16 outputs
    cfg.rows[t] = 8;
    cfg.colsb[t] = 64;
  }
  load_tile_config(cfg);
}

// The int32 dots of block b into c (16 x 16), through tile set S.
template <int S>
MINIVLLM_AMX_INT8_INLINE void block_dots(const int8_t* xq, int64_t K, const int8_t* codes, int64_t b, int32_t* c) {
  if constexpr (S == 0) {
    _tile_zero(0);
    _tile_loadd(2, xq + 32 * b, K);
    _tile_loadd(3, codes + kBlockCodes * b, 64);
    _tile_dpbssd(0, 2, 3);
    _tile_stored(0, c, 64);
  } else {
    _tile_zero(1);
    _tile_loadd(4, xq + 32 * b, K);
    _tile_loadd(5, codes + kBlockCodes * b, 64);
    _tile_dpbssd(1, 4, 5);
    _tile_stored(1, c, 64);
  }
}

// Blocks [b0, b1) of a 16-row tile through the two tile sets alternately, block b + 1's tile steps
// issued before block b is scaled: scale(c, b) gets each block's 16 x 16 int32 dots, in order.
template <typename Scale>
MINIVLLM_AMX_INT8_INLINE void dots_in_order(const int8_t* xq, int64_t K, const int8_t* codes, int64_t b0, int64_t b1,
                                            Scale& scale) {
  alignas(64) int32_t c[2][256];
  block_dots<0>(xq, K, codes, b0, c[0]);
  for (int64_t b = b0 + 1; b < b1; b += 2) {
    block_dots<1>(xq, K, codes, b, c[1]);
    scale(c[0], b - 1);
    if (b + 1 < b1) block_dots<0>(xq, K, codes, b + 1, c[0]);
    scale(c[1], b);
  }
  if ((b1 - b0) % 2 == 1) scale(c[0], b1 - 1);
}

// The 32-k block types: acc[r] += float(c[r]) * (d * x.scale) (+ minimum * x.scaled_sum), the VNNI
// tile's operations. xs, xsum: the tile's [num_blocks, 16] activation scales and scaled sums.
template <int64_t T>
struct BlockScaling {
  const float *scales, *mins, *xs, *xsum;
  __m512* acc;
  MINIVLLM_AMX_INT8_INLINE void operator()(const int32_t* c, int64_t b) {
    const __m512 d = _mm512_loadu_ps(scales + 16 * b);
    __m512 dm = _mm512_setzero_ps();
    if constexpr (has_block_min(T)) dm = _mm512_loadu_ps(mins + 16 * b);
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(xs[16 * b + r]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * r)), scale, acc[r]);
      if constexpr (has_block_min(T)) acc[r] = _mm512_fmadd_ps(dm, _mm512_set1_ps(xsum[16 * b + r]), acc[r]);
    }
  }
};

// Q4_K / Q5_K: block b's sums times its 6-bit scale into acc_scaled, as the VNNI tile's
// cvt(sum * sc) (float(sum) * sc is that product exactly: below 2^24), times the row's scale.
struct SubBlockScaling {
  const float *sub_scales, *xs;
  __m512* acc_scaled;
  MINIVLLM_AMX_INT8_INLINE void operator()(const int32_t* c, int64_t b) {
    const __m512 sc = _mm512_loadu_ps(sub_scales + 16 * b);
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r)
      acc_scaled[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * r)), sc),
                                      _mm512_set1_ps(xs[16 * b + r]), acc_scaled[r]);
  }
};

template <int64_t T>
MINIVLLM_AMX_INT8 void tile16(const QuantActs& a, int64_t m0, const QuantAmxPanel& p, float* out) {
  const int64_t nb = a.num_blocks;  // m0: a multiple of 16, so the tile's scales start at m0 * nb
  __m512 acc[16];
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
  BlockScaling<T> scale{p.scales.data(), p.mins.data(), a.tile_scales + m0 * nb, a.tile_sums + m0 * nb, acc};
  dots_in_order(a.q + m0 * a.K, a.K, p.codes, 0, nb, scale);
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

// A K-quant panel's tile: per record its 8 blocks' scaled sums, then the record's minimums
// (each block's 6-bit minimum times the row's scaled sum), and acc = fnmadd(dmin, minimums,
// fma(d, scaled sums, acc)): the VNNI tile's sub_block_record, operation for operation.
template <int64_t T>
MINIVLLM_AMX_INT8 void tile16_k(const QuantActs& a, int64_t m0, const QuantAmxPanel& p, float* out) {
  constexpr int64_t kPerRecord = quant_format(T).blocks_per_record;
  const int64_t nb = a.num_blocks;
  const float* xsum = a.tile_sums + m0 * nb;
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) _mm512_storeu_ps(out + 16 * r, _mm512_setzero_ps());
  for (int64_t rec = 0; rec < nb / kPerRecord; ++rec) {
    __m512 acc_scaled[16];
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) acc_scaled[r] = _mm512_setzero_ps();
    const int64_t b0 = rec * kPerRecord;
    SubBlockScaling scale{p.sub_scales.data(), a.tile_scales + m0 * nb, acc_scaled};
    dots_in_order(a.q + m0 * a.K, a.K, p.codes, b0, b0 + kPerRecord, scale);
    const __m512 d = _mm512_loadu_ps(p.scales.data() + 16 * rec), dmin = _mm512_loadu_ps(p.mins.data() + 16 * rec);
    for (int r = 0; r < 16; ++r) {
      __m512 acc_min = _mm512_setzero_ps();
      for (int64_t j = 0; j < kPerRecord; ++j)
        acc_min = _mm512_fmadd_ps(_mm512_loadu_ps(p.sub_mins.data() + 16 * (b0 + j)),
                                  _mm512_set1_ps(xsum[16 * (b0 + j) + r]), acc_min);
      const __m512 o = _mm512_loadu_ps(out + 16 * r);
      _mm512_storeu_ps(out + 16 * r, _mm512_fnmadd_ps(dmin, acc_min, _mm512_fmadd_ps(d, acc_scaled[r], o)));
    }
  }
}

MINIVLLM_AMX_INT8 void release_quant_tiles() { _tile_release(); }

}  // namespace

bool can_run_quant_amx(int64_t type) {
  static const bool amx_int8 = best_isa() >= kIsaAmx && cpu_has_amx_int8();
  return amx_int8 && has_amx_tile(type);
}

void QuantAmxPanel::unpack(int64_t panel_type, const uint8_t* panel, int64_t num_records) {
  type = panel_type;
  num_blocks = num_records * quant_format(type).blocks_per_record;
  if (static_cast<int64_t>(storage.size()) < num_blocks * kBlockCodes + 64) storage.resize(num_blocks * kBlockCodes + 64);
  codes = storage.data() + (64 - reinterpret_cast<uintptr_t>(storage.data()) % 64) % 64;
  if (static_cast<int64_t>(scales.size()) < num_blocks * 16) {
    scales.resize(num_blocks * 16);
    mins.resize(num_blocks * 16);
  }
  with_quant_type(type, [&](auto t) {
    constexpr int64_t T = decltype(t)::value;
    if constexpr (has_sub_block_min(T)) {
      if (static_cast<int64_t>(sub_scales.size()) < num_blocks * 16) {
        sub_scales.resize(num_blocks * 16);
        sub_mins.resize(num_blocks * 16);
      }
      unpack_k_panel<T>(panel, num_records, codes, scales.data(), mins.data(), sub_scales.data(), sub_mins.data());
    } else if constexpr (has_amx_tile(T)) {
      unpack_panel<T>(panel, num_records, codes, scales.data(), mins.data());
    }
  });
}

QuantAmxTiles::QuantAmxTiles() { configure_quant_tiles(); }
QuantAmxTiles::~QuantAmxTiles() { release_quant_tiles(); }

void QuantAmxTiles::tile(const QuantActs& a, int64_t m0, const QuantAmxPanel& p, float* acc) const {
  with_quant_type(p.type, [&](auto t) {
    constexpr int64_t T = decltype(t)::value;
    if constexpr (has_sub_block_min(T)) {
      tile16_k<T>(a, m0, p, acc);
    } else if constexpr (has_amx_tile(T)) {
      tile16<T>(a, m0, p, acc);
    }
  });
}

}  // namespace minivllm

#else

namespace minivllm {
bool can_run_quant_amx(int64_t) { return false; }
void QuantAmxPanel::unpack(int64_t, const uint8_t*, int64_t) {}
QuantAmxTiles::QuantAmxTiles() = default;
QuantAmxTiles::~QuantAmxTiles() = default;
void QuantAmxTiles::tile(const QuantActs&, int64_t, const QuantAmxPanel&, float*) const {}  // not reached
}  // namespace minivllm

#endif
