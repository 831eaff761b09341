// GGUF's quantized blocks as the integer-dot kernels read them (quant_gemm.cpp and its tiles).
//
// A weight of N output channels and K inputs keeps its file's codes and scales, repacked at load
// (engine/execution/models/quantized_weight.py) into panels of 16 output channels,
// [ceil(N/16), records, record_bytes] uint8: a panel is one contiguous stream of records, each
// one GGUF block (32 k: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4) or super-block (256 k: Q4_K, Q5_K, Q6_K) of all 16 rows,
// its scales first (16 per field, row order), then its codes, 32 k at a time. A 32-k block's
// codes are 64-byte groups, one vpdpbusd operand each: group t holds, at byte r * 4 + i, row r's
// code of k = 4t + i, so one broadcast of 4 activation bytes multiplies all 16 rows.
//   4-bit (Q4_0, Q4_1, Q4_K, MXFP4): 4 groups; the low nibble is k = 4t + i, the high one k = 16 + 4t + i.
//   5-bit (Q5_0, Q5_1, Q5_K): the code's low 4 bits as 4-bit blocks, then 1 group of its top bits:
//     byte r * 4 + i, bit t: k = 4t + i; bit 4 + t: k = 16 + 4t + i (t < 4).
//   Q8_0: 8 groups of code + 128 (the file's int8 made unsigned, as vpdpbusd's first operand is).
//   Q6_K: the 6-bit code's low 4 bits as 4-bit blocks, then 2 groups of its top 2 bits: group s,
//     byte r * 4 + i, bits 0-1 / 2-3 / 4-5 / 6-7: k = 4(2s) + i, 16 + 4(2s) + i, 4(2s + 1) + i,
//     16 + 4(2s + 1) + i.
// Record headers (f16: IEEE half as in the file):
//   Q4_0: d f16[16]                      w = d (q - 8)
//   Q4_1: d f16[16], m f16[16]           w = d q + m
//   Q5_0: d f16[16]                      w = d (q - 16)
//   Q5_1: d f16[16], m f16[16]           w = d q + m
//   Q8_0: d f16[16]                      w = d (u - 128)
//   Q4_K, Q5_K: d, dmin f16[16]; 192 bytes of 6-bit sc[8][16], mn[8][16] (per 32 k)   w = d sc q - dmin mn
//   Q6_K: d f16[16]; sc[16][16] i8 (per 16 k)                                 w = d sc (q - 32)
//   MXFP4: e u8[16] (E8M0)               w = 2^(e - 128) kMxfp4Values[q] (the E2M1 values doubled)
// MXFP4's codes stay 4-bit in memory: the tiles turn them into kMxfp4Values[q] + 12 (unsigned, as
// vpdpbusd's operand must be) by a byte shuffle, and take 12 times the activations' sum back.
// Q4_K's and Q5_K's 6-bit scales and minimums stay 6 bits, so every record holds exactly the file's
// bytes for its 16 rows (Q4_K 16 x 144, Q5_K 16 x 176): at header byte 64 + 16j + r, row r's scale
// of sub-block j in the low nibble and its minimum's in the high one; at 192 + 16(j % 4) + r, their
// top 2 bits, bits 0-1 and 2-3 for j < 4, 4-5 and 6-7 for j >= 4. The tiles unpack a record's 256
// values at once with a few byte-wise shifts and masks (sub_block_scale has them one at a time).
//
// Activations are quantized per 32 k to int8 (x ~ scale * q, |q| <= 127, round to nearest even;
// quantize_rows_avx512 gives -128 where the scalar one gives 0: a block whose maximum is below
// 127 / FLT_MAX or not finite) and the products are integer dot products of each 32-k block,
// scaled once per block.
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

namespace minivllm {

// ggml_type ids of the formats with kernels.
enum QuantType : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kMXFP4 = 39
};

// MXFP4's code -> twice its E2M1 value, integers (ggml's table), and the offset that makes them unsigned.
constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
constexpr int32_t kMxfp4Offset = 12;

// An E8M0 scale byte as a float32 halved (the table's doubling undone): 2^(e - 128), the bits
// ggml's ggml_e8m0_to_fp32_half builds (subnormal for e < 2).
constexpr uint32_t e8m0_half_bits(uint8_t e) { return e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23; }

// The 5-bit types: 4-bit codes plus a group of top bits a 32-k block.
constexpr bool is_5bit(int64_t type) { return type == kQ5_0 || type == kQ5_1 || type == kQ5_K; }
// w = d q + m (a float minimum a block) and w = d sc q - dmin mn (6-bit minimums a sub-block).
constexpr bool has_block_min(int64_t type) { return type == kQ4_1 || type == kQ5_1; }
constexpr bool has_sub_block_min(int64_t type) { return type == kQ4_K || type == kQ5_K; }

struct QuantFormat {
  int64_t blocks_per_record = 0;  // 32-k blocks: 1, or 8 in a super-block
  int64_t header_bytes = 0;       // the scales before the codes
  int64_t block_bytes = 0;        // one 32-k block's codes
  constexpr int64_t record_bytes() const { return header_bytes + blocks_per_record * block_bytes; }
  constexpr int64_t record_k() const { return 32 * blocks_per_record; }
};

// {0, 0, 0} for a type without kernels.
constexpr QuantFormat quant_format(int64_t type) {
  switch (type) {
    case kQ4_0: return {1, 32, 256};
    case kQ4_1: return {1, 64, 256};
    case kQ5_0: return {1, 32, 320};
    case kQ5_1: return {1, 64, 320};
    case kQ8_0: return {1, 32, 512};
    case kQ4_K: return {8, 256, 256};
    case kQ5_K: return {8, 256, 320};
    case kQ6_K: return {8, 288, 384};
    case kMXFP4: return {1, 16, 256};
    default: return {};
  }
}

// The type of a panel's records by their size: every type with kernels has a record size of its
// own, so uint8 panels in a packed projection's slot (packed_gemm's dispatch, DecodeModel's
// embedding) say their type by their shape. 0 for a size no type has.
constexpr int64_t quant_type_of_record(int64_t record_bytes) {
  constexpr int64_t kTypes[] = {kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ8_0, kQ4_K, kQ5_K, kQ6_K, kMXFP4};
  for (const int64_t type : kTypes)
    if (quant_format(type).record_bytes() == record_bytes) return type;
  return 0;
}
static_assert(quant_type_of_record(quant_format(kQ4_0).record_bytes()) == kQ4_0 &&
                  quant_type_of_record(quant_format(kQ4_1).record_bytes()) == kQ4_1 &&
                  quant_type_of_record(quant_format(kQ5_0).record_bytes()) == kQ5_0 &&
                  quant_type_of_record(quant_format(kQ5_1).record_bytes()) == kQ5_1 &&
                  quant_type_of_record(quant_format(kQ5_K).record_bytes()) == kQ5_K &&
                  quant_type_of_record(quant_format(kQ8_0).record_bytes()) == kQ8_0 &&
                  quant_type_of_record(quant_format(kQ4_K).record_bytes()) == kQ4_K &&
                  quant_type_of_record(quant_format(kQ6_K).record_bytes()) == kQ6_K &&
                  quant_type_of_record(quant_format(kMXFP4).record_bytes()) == kMXFP4,
              "each quantized type's record size is its own");

// Q4_K's and Q5_K's header (the layout above): the scale (and the minimum, is_min) of row r < 16
// in sub-block j < 8, 0..63.
constexpr int64_t kSubScaleLowBytes = 64, kSubScaleTopBytes = 192;  // their offsets in the header
constexpr uint8_t sub_block_scale(const uint8_t* rec, int64_t j, int64_t r, bool is_min) {
  const int low = (rec[kSubScaleLowBytes + 16 * j + r] >> (is_min ? 4 : 0)) & 0x0F;
  const int top = (rec[kSubScaleTopBytes + 16 * (j % 4) + r] >> ((j < 4 ? 0 : 4) + (is_min ? 2 : 0))) & 3;
  return static_cast<uint8_t>(low | (top << 4));
}

// One row's 32-k block of activations: x ~ scale * q; sums of q over its two halves; scale *
// (sum of all 32), what a block's minimum (Q4_1, Q4_K) multiplies.
struct BlockActs {
  float scale, scaled_sum;
  int32_t sum_lo, sum_hi;
};

// x [M, K] quantized: q [M, K] int8, blocks [M, K / 32].
struct QuantActs {
  const int8_t* q;
  const BlockActs* blocks;
  int64_t K, num_blocks;
  // For the AMX tiles (else nullptr): each 16-row tile's block scales and scaled sums as
  // [ceil(M / 16), num_blocks, 16] float32, so that a block's 16 rows are one line, each row a
  // broadcast at a fixed offset (no 16 row pointers for the tile to keep).
  const float* tile_scales = nullptr;
  const float* tile_sums = nullptr;
};

// x [M, K] rows ldx apart -> q [M, K], blocks [M, K / 32]: scale = max |x| / 127 a block and q = x *
// (127 / max |x|) rounded to nearest even (float32 operations the tests replay). The AVX-512 one
// gives the same bytes and floats, but at the edge above.
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t ldx, int8_t* q, BlockActs* blocks);
void quantize_rows_avx512(const float* x, int64_t M, int64_t K, int64_t ldx, int8_t* q, BlockActs* blocks);

// acc[rows, 16] = the `rows` rows from m0 of the activations . one panel of `type`
// (num_records records), rows <= kMaxQuantTileRows. The vector paths need the CPU features they
// are named for (quant_gemm.cpp checks).
constexpr int64_t kMaxQuantTileRows = 4;

// f(std::integral_constant<int64_t, T>{}) for the kernel type T that `type` names: the one switch
// the ISA files' tiles dispatch on. A type without kernels runs nothing (check_quant_weight has
// refused it before any product).
template <typename F>
inline void with_quant_type(int64_t type, const F& f) {
  switch (type) {
    case kQ4_0: return f(std::integral_constant<int64_t, kQ4_0>{});
    case kQ4_1: return f(std::integral_constant<int64_t, kQ4_1>{});
    case kQ5_0: return f(std::integral_constant<int64_t, kQ5_0>{});
    case kQ5_1: return f(std::integral_constant<int64_t, kQ5_1>{});
    case kQ8_0: return f(std::integral_constant<int64_t, kQ8_0>{});
    case kQ4_K: return f(std::integral_constant<int64_t, kQ4_K>{});
    case kQ5_K: return f(std::integral_constant<int64_t, kQ5_K>{});
    case kQ6_K: return f(std::integral_constant<int64_t, kQ6_K>{});
    case kMXFP4: return f(std::integral_constant<int64_t, kMXFP4>{});
    default: return;
  }
}
// quant_gemm's task: rows [m_begin, m_end) of the quantized activations against panels
// [p_begin, p_end) of w (out's columns of those panels, N outputs in all, bias [N] or nullptr), on
// the calling thread. For callers that quantize their rows once and split products their own way
// (moe_experts.cpp: every routed expert's rows in one pass).
struct QuantPanels;
void quant_gemm_task(const QuantActs& a, const QuantPanels& w, int64_t isa, const float* bias, int64_t N, float* out,
                     int64_t ldo, bool accumulate, int64_t m_begin, int64_t m_end, int64_t p_begin, int64_t p_end);
void quant_tile_scalar(int64_t type, int64_t rows, const QuantActs& a, int64_t m0, const uint8_t* panel,
                       int64_t num_records, float* acc);
void quant_tile_avx2(int64_t type, int64_t rows, const QuantActs& a, int64_t m0, const uint8_t* panel,
                     int64_t num_records, float* acc);
// The VNNI tile takes num_panels panels at once, panel_stride bytes apart (num_panels: 1, or
// quant_tile_panels(type, rows)): acc [num_panels, rows, 16]. Their dots share each broadcast of
// the activations and are independent chains.
constexpr int64_t kMaxQuantTilePanels = 4;
int64_t quant_tile_panels(int64_t type, int64_t rows);
void quant_tile_vnni(int64_t type, int64_t rows, const QuantActs& a, int64_t m0, const uint8_t* panel,
                     int64_t num_records, float* acc, int64_t num_panels = 1, int64_t panel_stride = 0);
// The same tile with a Q4_K / Q5_K / Q6_K record's top bits moved by GFNI (gfni, refused where the
// CPU lacks it) or by the shifts and masks a VNNI CPU without GFNI runs: tests run both on a GFNI
// CPU, where the engine only ever runs the first.
void quant_tile_vnni_unpack(bool gfni, int64_t type, int64_t rows, const QuantActs& a, int64_t m0,
                            const uint8_t* panel, int64_t num_records, float* acc, int64_t num_panels,
                            int64_t panel_stride);

// AMX-INT8 (quant_tiles_amx.cpp): the 32-k block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4) and
// Q4_K, Q5_K on a CPU with AMX-INT8 whose tiles the process may use. The outputs are the VNNI
// tile's, bit for bit. Q6_K stays on VNNI.
bool can_run_quant_amx(int64_t type);

// One panel unpacked for the tile unit: codes [num_blocks, 8, 64] int8 (block b's B operand: the
// codes less the type's offset), scales and minimums [num_blocks, 16] float32 (Q4_K, Q5_K: d and
// dmin [records, 16], and each block's 6-bit scale and minimum as floats in sub_scales, sub_mins
// [num_blocks, 16]). Kept a thread, grown.
struct QuantAmxPanel {
  int64_t type = 0, num_blocks = 0;
  int8_t* codes = nullptr;  // 64-byte aligned, in storage: a tile row across two cache lines loads slower
  std::vector<float> scales, mins, sub_scales, sub_mins;
  void unpack(int64_t panel_type, const uint8_t* panel, int64_t num_records);

 private:
  std::vector<int8_t> storage;
};

// The tiles configured for the quantized products while it lives (released after). tile: acc [16,
// 16] = rows [m0, m0 + 16) of a . the panel; a's buffers must hold those rows (pad rows past M
// give outputs no one stores), a.q 64-byte aligned (as the panel's codes, for the same reason).
class QuantAmxTiles {
 public:
  QuantAmxTiles();
  ~QuantAmxTiles();
  QuantAmxTiles(const QuantAmxTiles&) = delete;
  QuantAmxTiles& operator=(const QuantAmxTiles&) = delete;
  void tile(const QuantActs& a, int64_t m0, const QuantAmxPanel& p, float* acc) const;
};

}  // namespace minivllm
