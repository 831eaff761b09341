// Matrix products against GGUF's quantized blocks, kept packed (quant_tiles.h has the layout):
// the activations quantized per 32 k to int8 once a product, then integer dot products per block
// on the tiles of the chosen path (AVX-512 VNNI, AVX2, or the scalar reference here), their sums
// scaled to float once a block. Panels run in parallel as packed_gemm's do: tasks of a few
// panels from a shared counter, or a team's share of them (DecodeModel's step).
#include "cpu_kernels.h"
#include "quant_tiles.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

namespace minivllm {
namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kBlock = 32;       // activations are quantized per this many k
constexpr int64_t kRowBlock = 64;    // rows of x a task keeps hot while it walks its panels
// On AMX-INT8 a task unpacks each of its panels once, for all its rows: more rows per task repay it.
constexpr int64_t kAmxRowBlock = 512;
constexpr int64_t kAmxMinRows = 16;  // fewer rows stay on VNNI, whose tiles take 1 to 4 rows
constexpr int64_t kTasksPerThread = 4;

float half_at(const uint8_t* p, int64_t i) {
  uint16_t bits;
  std::memcpy(&bits, p + 2 * i, sizeof(bits));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Row r's unsigned code of k (< 32) in a 32-k block's codes c.
int32_t code_at(int64_t type, const uint8_t* c, int64_t r, int64_t k) {
  if (type == kQ8_0) return c[(k / 4) * 64 + r * 4 + k % 4];
  const int64_t kk = k % 16, t = kk / 4, at = t * 64 + r * 4 + kk % 4;
  const int32_t low = k < 16 ? c[at] & 0x0F : c[at] >> 4;
  if (is_5bit(type)) return low | (((c[256 + r * 4 + kk % 4] >> (k < 16 ? t : 4 + t)) & 1) << 4);
  if (type != kQ6_K) return low;
  const int32_t shift = (t % 2) * 4 + (k < 16 ? 0 : 2);
  return low | (((c[256 + (t / 2) * 64 + r * 4 + kk % 4] >> shift) & 3) << 4);
}

// Row r's MXFP4 scale in a record's header: 2^(e - 128).
float e8m0_half_at(const uint8_t* rec, int64_t r) {
  const uint32_t bits = e8m0_half_bits(rec[r]);
  float d;
  std::memcpy(&d, &bits, sizeof(d));
  return d;
}

// The unsigned operand the vector tiles multiply for row r's code at k: the code itself, or
// MXFP4's value + 12 (its table lookup).
int32_t operand_at(int64_t type, const uint8_t* c, int64_t r, int64_t k) {
  const int32_t code = code_at(type, c, r, k);
  return type == kMXFP4 ? kMxfp4Values[code] + kMxfp4Offset : code;
}

// The weight of row r (< 16) at k (< 32) of 32-k block j of a record, as the gguf package
// dequantizes it (each operation's rounding the same).
float weight_at(int64_t type, const uint8_t* rec, int64_t j, int64_t r, int64_t k) {
  const QuantFormat f = quant_format(type);
  const int32_t raw = code_at(type, rec + f.header_bytes + j * f.block_bytes, r, k);
  if (type == kMXFP4) return e8m0_half_at(rec, r) * static_cast<float>(kMxfp4Values[raw]);
  const auto code = static_cast<float>(raw);
  const float d = half_at(rec, r);
  switch (type) {
    case kQ4_0: return d * (code - 8.f);
    case kQ4_1: return d * code + half_at(rec + 32, r);
    case kQ5_0: return d * (code - 16.f);
    case kQ5_1: return d * code + half_at(rec + 32, r);
    case kQ8_0: return (code - 128.f) * d;
    case kQ4_K:
    case kQ5_K:
      return d * static_cast<float>(sub_block_scale(rec, j, r, false)) * code -
             half_at(rec + 32, r) * static_cast<float>(sub_block_scale(rec, j, r, true));
    default: return d * static_cast<float>(static_cast<int8_t>(rec[32 + 16 * (2 * j + k / 16) + r])) * (code - 32.f);
  }
}

}  // namespace

// The reference the vector tiles are tested against: the same integer sums, one code at a time.
void quant_tile_scalar(int64_t type, int64_t rows, const QuantActs& a, int64_t m0, const uint8_t* w,
                       int64_t num_records, float* acc) {
  const QuantFormat f = quant_format(type);
  std::fill(acc, acc + rows * kPanel, 0.f);
  for (int64_t rec = 0; rec < num_records; ++rec, w += f.record_bytes()) {
    for (int64_t j = 0; j < f.blocks_per_record; ++j) {
      const uint8_t* c = w + f.header_bytes + j * f.block_bytes;
      const int64_t b = rec * f.blocks_per_record + j;
      for (int64_t m = 0; m < rows; ++m) {
        const int8_t* xq = a.q + (m0 + m) * a.K + b * kBlock;
        const BlockActs& x = a.blocks[(m0 + m) * a.num_blocks + b];
        for (int64_t r = 0; r < kPanel; ++r) {
          int32_t lo = 0, hi = 0;
          for (int64_t k = 0; k < kBlock; ++k) (k < 16 ? lo : hi) += operand_at(type, c, r, k) * xq[k];
          const float d = type == kMXFP4 ? e8m0_half_at(w, r) : half_at(w, r);
          float scale = d, minimum = 0.f;
          int32_t sum = lo + hi;
          switch (type) {
            case kQ4_0: sum -= 8 * (x.sum_lo + x.sum_hi); break;
            case kQ4_1: minimum = half_at(w + 32, r); break;
            case kQ5_0: sum -= 16 * (x.sum_lo + x.sum_hi); break;
            case kQ5_1: minimum = half_at(w + 32, r); break;
            case kQ8_0: sum -= 128 * (x.sum_lo + x.sum_hi); break;
            case kMXFP4: sum -= kMxfp4Offset * (x.sum_lo + x.sum_hi); break;
            case kQ4_K:
            case kQ5_K:
              scale = d * static_cast<float>(sub_block_scale(w, j, r, false));
              minimum = -half_at(w + 32, r) * static_cast<float>(sub_block_scale(w, j, r, true));
              break;
            default:  // Q6_K
              sum = (lo - 32 * x.sum_lo) * static_cast<int8_t>(w[32 + 16 * (2 * j) + r]) +
                    (hi - 32 * x.sum_hi) * static_cast<int8_t>(w[32 + 16 * (2 * j + 1) + r]);
          }
          acc[m * kPanel + r] += static_cast<float>(sum) * (scale * x.scale) + minimum * x.scaled_sum;
        }
      }
    }
  }
}

void quantize_rows(const float* x, int64_t M, int64_t K, int64_t ldx, int8_t* q, BlockActs* blocks) {
  const int64_t num_blocks = K / kBlock;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < num_blocks; ++b) {
      const float* xb = x + m * ldx + b * kBlock;
      float amax = 0.f;
      for (int64_t k = 0; k < kBlock; ++k) amax = std::max(amax, std::fabs(xb[k]));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t sums[2] = {0, 0};
      for (int64_t k = 0; k < kBlock; ++k) {
        const auto v = static_cast<int32_t>(std::nearbyint(xb[k] * inv));
        q[m * K + b * kBlock + k] = static_cast<int8_t>(v);
        sums[k / 16] += v;
      }
      const float scale = amax / 127.f;
      blocks[m * num_blocks + b] = {scale, scale * static_cast<float>(sums[0] + sums[1]), sums[0], sums[1]};
    }
  }
}

namespace {

// Whether this CPU runs the VNNI tiles (AVX-512 without VNNI, Skylake-X, runs the AVX2 ones).
bool has_vnni() {
#if defined(__x86_64__)
  static const bool vnni = __builtin_cpu_supports("avx512vnni");
  return vnni;
#else
  return false;
#endif
}

// Whether this CPU runs the VNNI tiles (AVX-512 without VNNI, Skylake-X, runs the AVX2 ones).
bool runs_vnni(int64_t isa) { return isa >= kIsaAvx512 && has_vnni(); }

void run_tile(int64_t type, int64_t isa, int64_t rows, const QuantActs& a, int64_t m0, const uint8_t* panel,
              int64_t num_records, float* acc) {
  if (runs_vnni(isa)) return quant_tile_vnni(type, rows, a, m0, panel, num_records, acc);
  if (isa >= kIsaAvx2) return quant_tile_avx2(type, rows, a, m0, panel, num_records, acc);
  quant_tile_scalar(type, rows, a, m0, panel, num_records, acc);
}

// x's rows quantized per 32 k (QuantActs), in buffers of their own.
struct ActsBuffer {
  std::vector<int8_t> q;
  std::vector<BlockActs> blocks;
  std::vector<float> tile_scales, tile_sums;

  // a's block scales and scaled sums for the AMX tiles (QuantActs::tile_scales), rows past M zero.
  QuantActs with_tiles(QuantActs a, int64_t M) {
    const int64_t num_tiles = (M + 15) / 16, nb = a.num_blocks;
    if (static_cast<int64_t>(tile_scales.size()) < num_tiles * nb * 16) {
      tile_scales.resize(num_tiles * nb * 16);
      tile_sums.resize(num_tiles * nb * 16);
    }
    at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t r = 0; r < 16; ++r) {
          const int64_t m = 16 * t + r;
          float* xs = tile_scales.data() + t * nb * 16 + r;
          float* xsum = tile_sums.data() + t * nb * 16 + r;
          for (int64_t b = 0; b < nb; ++b) {
            xs[16 * b] = m < M ? a.blocks[m * nb + b].scale : 0.f;
            xsum[16 * b] = m < M ? a.blocks[m * nb + b].scaled_sum : 0.f;
          }
        }
      }
    });
    a.tile_scales = tile_scales.data();
    a.tile_sums = tile_sums.data();
    return a;
  }

  QuantActs quantize(const float* x, int64_t M, int64_t K, int64_t ldx, int64_t isa, bool parallel) {
    const int64_t num_blocks = K / kBlock;
    // Grown, never shrunk: K alternates between a layer's widths, and growing a vector back
    // zero-fills what it regains.
    // Whole 16-row tiles: the AMX tile reads rows up to the next multiple of 16.
    const int64_t padded = (M + 15) / 16 * 16;
    if (static_cast<int64_t>(q.size()) < padded * K + 64) q.resize(padded * K + 64);
    int8_t* q_at = q.data() + (64 - reinterpret_cast<uintptr_t>(q.data()) % 64) % 64;  // as the AMX tile loads it best
    if (static_cast<int64_t>(blocks.size()) < M * num_blocks) blocks.resize(M * num_blocks);
    const auto rows = [&](int64_t begin, int64_t end) {
      const auto quantize = isa >= kIsaAvx512 ? quantize_rows_avx512 : quantize_rows;
      quantize(x + begin * ldx, end - begin, K, ldx, q_at + begin * K, blocks.data() + begin * num_blocks);
    };
    if (parallel) {
      at::parallel_for(0, M, 16, rows);
    } else {
      rows(0, M);
    }
    return {q_at, blocks.data(), K, num_blocks};
  }
};

inline void store_tile(const float* acc, int64_t rows, int64_t m0, int64_t n0, int64_t width, const float* bias,
                       float* out, int64_t ldo, bool accumulate) {
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + (m0 + r) * ldo + n0;
    const float* a = acc + r * kPanel;
#pragma omp simd
    for (int64_t j = 0; j < width; ++j) o[j] = (accumulate ? o[j] : 0.f) + a[j] + (bias != nullptr ? bias[n0 + j] : 0.f);
  }
}

// The thread's unpacked panel, kept between tasks (grown, never shrunk); asked for only on the
// AMX branch, so decode teams and MoE tasks never set one up.
QuantAmxPanel& thread_amx_panel() {
  thread_local QuantAmxPanel panel;
  return panel;
}

// One task's rows [m_begin, m_end) against panels [p_begin, p_end) of the parts' run (a part's
// panels follow the part before's: panel p holds outputs [16 p, 16 p + 16) whichever part it is in).
// amx: rows of a product that runs its AMX types (can_run_quant_amx) on AMX-INT8 (quant_gemm decides).
void run_task(const QuantActs& a, const QuantPanels* parts, int64_t isa, const float* bias, int64_t N, float* out,
              int64_t ldo, bool accumulate, int64_t m_begin, int64_t m_end, int64_t p_begin, int64_t p_end,
              bool amx = false) {
  static_assert(kMaxQuantTilePanels * kMaxQuantTileRows >= 16, "acc holds an AMX tile's 16 rows");
  alignas(64) float acc[kMaxQuantTilePanels * kMaxQuantTileRows * kPanel];
  QuantAmxPanel* amx_panel = nullptr;  // looked up at the task's first AMX panel, once
  std::optional<QuantAmxTiles> amx_tiles;  // configured at the task's first AMX panel
  const auto store = [&](const float* tile, int64_t rows, int64_t m0, int64_t p) {
    store_tile(tile, rows, m0, p * kPanel, std::min(kPanel, N - p * kPanel), bias, out, ldo, accumulate);
  };
  const QuantPanels* w = parts;
  int64_t first = 0;  // w's first panel in the run
  for (int64_t p = p_begin; p < p_end;) {
    while (p >= first + w->num_panels) first += (w++)->num_panels;
    const int64_t end = std::min(p_end, first + w->num_panels);  // this part's panels in the task
    const int64_t panel_bytes = w->num_records * w->record_bytes;
    const uint8_t* panel = w->data + (p - first) * panel_bytes;
    // One or two rows on VNNI: G panels at once, each from its own quarter (half) of the run, so
    // that each of the tile's G weight streams stays one contiguous read from panel to panel (G
    // neighbouring panels would restart G - 1 streams every group: slower from memory).
    const int64_t rows = m_end - m_begin;
    if (amx && can_run_quant_amx(w->type)) {
      if (!amx_tiles) {
        amx_tiles.emplace();
        amx_panel = &thread_amx_panel();
      }
      amx_panel->unpack(w->type, panel, w->num_records);
      for (int64_t m0 = m_begin; m0 < m_end; m0 += 16) {
        amx_tiles->tile(a, m0, *amx_panel, acc);
        store(acc, std::min<int64_t>(16, m_end - m0), m0, p);
      }
      ++p;
      continue;
    }
    const int64_t group = runs_vnni(isa) && rows <= 2 ? quant_tile_panels(w->type, rows) : 1;
    const int64_t span = (end - p) / group;  // panels each stream takes
    if (group > 1 && span > 0) {
      for (int64_t i = 0; i < span; ++i) {
        quant_tile_vnni(w->type, rows, a, m_begin, panel + i * panel_bytes, w->num_records, acc, group,
                        span * panel_bytes);
        for (int64_t q = 0; q < group; ++q) store(acc + q * rows * kPanel, rows, m_begin, p + q * span + i);
      }
      p += group * span;
      continue;
    }
    for (int64_t m0 = m_begin; m0 < m_end; m0 += kMaxQuantTileRows) {
      const int64_t tile_rows = std::min(kMaxQuantTileRows, m_end - m0);
      run_tile(w->type, isa, tile_rows, a, m0, panel, w->num_records, acc);
      store(acc, tile_rows, m0, p);
    }
    ++p;
  }
}

}  // namespace

void quant_gemm_task(const QuantActs& a, const QuantPanels& w, int64_t isa, const float* bias, int64_t N, float* out,
                     int64_t ldo, bool accumulate, int64_t m_begin, int64_t m_end, int64_t p_begin, int64_t p_end) {
  run_task(a, &w, isa, bias, N, out, ldo, accumulate, m_begin, m_end, p_begin, p_end);
}

QuantPanels QuantPanels::of(const torch::Tensor& w, int64_t type) {
  return {w.data_ptr<uint8_t>(), type, w.size(0), w.size(1), w.size(2)};
}

void check_quant_weight(const torch::Tensor& w, int64_t type, int64_t K, int64_t N, int64_t isa) {
  TORCH_CHECK(isa <= best_isa(), "quant_gemm: this CPU lacks the requested instruction set");
  const QuantFormat f = quant_format(type);
  TORCH_CHECK(f.blocks_per_record > 0, "quant_gemm: no kernel for ggml type ", type);
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.dim() == 3 && w.is_contiguous(),
              "quant_gemm: weight must be contiguous uint8 [ceil(N/16), records, record bytes]");
  TORCH_CHECK(w.size(0) * kPanel >= N && w.size(0) * kPanel < N + kPanel, "quant_gemm: ", w.size(0),
              " panels for ", N, " outputs");
  TORCH_CHECK(w.size(2) == f.record_bytes() && w.size(1) * f.record_k() == K, "quant_gemm: weight [", w.size(0), ", ",
              w.size(1), ", ", w.size(2), "] is not type ", type, " panels of K = ", K);
}

void check_quant_parts(const torch::Tensor& w, int64_t K, int64_t N, int64_t isa) {
  TORCH_CHECK(isa <= best_isa(), "quant_gemm: this CPU lacks the requested instruction set");
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.dim() == 1 && w.is_contiguous() &&
                  w.numel() >= kQuantPartsHeaderBytes,
              "quant_gemm: mixed-type parts must be contiguous uint8 [header + panels]");
  int32_t header[kQuantPartsHeaderBytes / 4];
  std::memcpy(header, w.data_ptr<uint8_t>(), sizeof(header));
  const int64_t num_parts = header[0];
  TORCH_CHECK(num_parts >= 1 && num_parts <= kMaxQuantParts, "quant_gemm: ", num_parts, " parts (1 to ",
              kMaxQuantParts, ")");
  int64_t num_panels = 0, num_bytes = kQuantPartsHeaderBytes;
  for (int64_t i = 0; i < num_parts; ++i) {
    const int64_t type = header[1 + 3 * i], panels = header[2 + 3 * i], records = header[3 + 3 * i];
    const QuantFormat f = quant_format(type);
    TORCH_CHECK(f.blocks_per_record > 0, "quant_gemm: part ", i, ": no kernel for ggml type ", type);
    TORCH_CHECK(panels > 0 && records * f.record_k() == K, "quant_gemm: part ", i, " of ", panels, " panels of ",
                records, " records is not type ", type, " panels of K = ", K);
    num_panels += panels;
    num_bytes += panels * records * f.record_bytes();
  }
  TORCH_CHECK(num_bytes == w.numel(), "quant_gemm: parts of ", num_bytes, " bytes in a tensor of ", w.numel());
  TORCH_CHECK(num_panels * kPanel >= N && num_panels * kPanel < N + kPanel, "quant_gemm: ", num_panels,
              " panels for ", N, " outputs");
}

void quant_gemm(const float* x, int64_t M, int64_t K, int64_t ldx, const QuantPanels& w, const float* bias, int64_t N,
                float* out, int64_t ldo, int64_t isa, bool accumulate, const TeamShare* team) {
  quant_gemm(x, M, K, ldx, &w, 1, bias, N, out, ldo, isa, accumulate, team);
}

void quant_gemm(const float* x, int64_t M, int64_t K, int64_t ldx, const QuantPanels* parts, int64_t num_parts,
                const float* bias, int64_t N, float* out, int64_t ldo, int64_t isa, bool accumulate,
                const TeamShare* team) {
  int64_t num_panels = 0;
  for (int64_t i = 0; i < num_parts; ++i) num_panels += parts[i].num_panels;
  const int64_t num_threads = num_workers(team);
  const int64_t chunk = std::max<int64_t>(1, (num_panels + kTasksPerThread * num_threads - 1) /
                                                 (kTasksPerThread * num_threads));
  const int64_t num_chunks = (num_panels + chunk - 1) / chunk;
  // AMX-INT8 for a product of many rows of its own (a team's share is a decode step's few rows).
  bool amx = false;
  for (int64_t i = 0; i < num_parts; ++i) amx |= can_run_quant_amx(parts[i].type);
  amx = amx && team == nullptr && isa >= kIsaAmx && M >= kAmxMinRows;
  const int64_t row_block = amx ? kAmxRowBlock : kRowBlock;
  const int64_t num_tasks = num_chunks * ((M + row_block - 1) / row_block);
  const auto task_runner = [&](const QuantActs& a) {
    return [&, a](int64_t task) {
      const int64_t m_begin = (task / num_chunks) * row_block, begin = (task % num_chunks) * chunk;
      run_task(a, parts, isa, bias, N, out, ldo, accumulate, m_begin, std::min(M, m_begin + row_block), begin,
               std::min(num_panels, begin + chunk), amx);
    };
  };
  // One buffer a thread, kept between products (no allocation and zero-fill each call). A team's
  // members each quantize x for themselves (a few rows: cheaper than waiting for one another); a
  // product of its own quantizes x once, before its threads fork.
  thread_local ActsBuffer acts;
  if (team != nullptr) return team->for_each_task(num_tasks, task_runner(acts.quantize(x, M, K, ldx, isa, false)));
  const QuantActs a = acts.quantize(x, M, K, ldx, isa, M >= 16);
  const auto run = task_runner(amx ? acts.with_tiles(a, M) : a);
  std::atomic<int64_t> next_task{0};
  const TeamShare forked{num_threads, &next_task};
  at::parallel_for(0, std::min(num_threads, num_tasks), 1, [&](int64_t, int64_t) { forked.for_each_task(num_tasks, run); });
}

void quant_gather_rows(const QuantPanels& p, const int64_t* ids, int64_t L, int64_t k, float* out) {
  const QuantFormat f = quant_format(p.type);
  for (int64_t i = 0; i < L; ++i) {
    const uint8_t* panel = p.data + (ids[i] / kPanel) * p.num_records * p.record_bytes;
    for (int64_t rec = 0; rec < p.num_records; ++rec)
      for (int64_t j = 0; j < f.blocks_per_record; ++j)
        for (int64_t kk = 0; kk < kBlock; ++kk)
          out[i * k + (rec * f.blocks_per_record + j) * kBlock + kk] =
              weight_at(p.type, panel + rec * p.record_bytes, j, ids[i] % kPanel, kk);
  }
}

torch::Tensor quant_rows(const torch::Tensor& w, int64_t type, const torch::Tensor& ids, int64_t n, int64_t k) {
  check_quant_weight(w, type, k, n, kIsaScalar);
  TORCH_CHECK(ids.scalar_type() == torch::kInt64 && ids.dim() == 1, "quant_rows: ids must be int64 [L]");
  const auto ids_c = ids.contiguous();
  const int64_t* id = ids_c.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.size(0); ++i) TORCH_CHECK(id[i] >= 0 && id[i] < n, "quant_rows: id ", id[i], " outside ", n, " rows");
  const QuantPanels p = QuantPanels::of(w, type);
  auto out = torch::empty({ids.size(0), k}, torch::kFloat32);  // [L, K]
  float* o = out.data_ptr<float>();
  at::parallel_for(0, ids.size(0), 16, [&](int64_t begin, int64_t end) {
    quant_gather_rows(p, id + begin, end - begin, k, o + begin * k);
  });
  return out;
}

// Tests: x [rows, K] (rows <= 4) against the first num_panels panels of w by the VNNI tile, its
// K-quant records unpacked with GFNI or without -> [num_panels, rows, 16] float32 (no bias).
torch::Tensor quant_tile_unpack(const torch::Tensor& x, const torch::Tensor& w, int64_t type, int64_t num_panels,
                                bool gfni) {
  TORCH_CHECK(runs_vnni(best_isa()), "quant_tile_unpack: this CPU lacks AVX-512 VNNI");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= 4, "quant_tile_unpack: x must be [rows <= 4, K]");
  const int64_t rows = x.size(0), K = x.size(1);
  check_quant_weight(w, type, K, w.size(0) * kPanel, kIsaAvx512);
  const QuantPanels q = QuantPanels::of(w, type);
  TORCH_CHECK(num_panels >= 1 && num_panels <= q.num_panels &&
              (num_panels == 1 || num_panels == quant_tile_panels(type, rows)),
              "quant_tile_unpack: num_panels must be 1 or quant_tile_panels(type, rows)");
  const auto xf = x.to(torch::kFloat32).contiguous();
  ActsBuffer acts;
  const QuantActs a = acts.quantize(xf.data_ptr<float>(), rows, K, K, kIsaAvx512, false);
  auto out = torch::empty({num_panels, rows, kPanel}, xf.options());
  quant_tile_vnni_unpack(gfni, type, rows, a, 0, q.data, q.num_records, out.data_ptr<float>(), num_panels,
                         q.num_records * q.record_bytes);
  return out;
}

torch::Tensor quant_tiles_amx(const torch::Tensor& x, const torch::Tensor& w, int64_t type) {
  TORCH_CHECK(can_run_quant_amx(type), "quant_tiles_amx: this CPU has no AMX-INT8 tiles for ggml type ", type);
  TORCH_CHECK(x.dim() == 2, "quant_tiles_amx: x must be [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  check_quant_weight(w, type, K, w.size(0) * kPanel, kIsaAmx);
  const QuantPanels q = QuantPanels::of(w, type);
  const auto xf = x.to(torch::kFloat32).contiguous();
  ActsBuffer acts;
  const QuantActs a = acts.with_tiles(acts.quantize(xf.data_ptr<float>(), M, K, K, kIsaAvx512, false), M);
  const int64_t N = q.num_panels * kPanel;
  auto out = torch::empty({M, N}, xf.options());
  // The product's own AMX branch on one thread, every row whatever M (quant_gemm needs 16)
  run_task(a, &q, kIsaAmx, nullptr, N, out.data_ptr<float>(), N, false, 0, M, 0, q.num_panels, true);
  return out;
}

torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t type,
                           const std::optional<torch::Tensor>& bias, int64_t n, int64_t isa) {
  TORCH_CHECK(x.dim() == 2, "quant_linear: x must be [M, K]");
  check_quant_weight(w, type, x.size(1), n, isa);
  TORCH_CHECK(!bias || (bias->scalar_type() == torch::kFloat32 && bias->numel() == n && bias->is_contiguous()),
              "quant_linear: bias must be contiguous float32 [n]");
  const auto xf = x.to(torch::kFloat32).contiguous();
  auto out = scratch_tensor({x.size(0), n}, xf.options());
  quant_gemm(xf.data_ptr<float>(), x.size(0), x.size(1), x.size(1), QuantPanels::of(w, type),
             bias ? bias->data_ptr<float>() : nullptr, n, out.data_ptr<float>(), n, isa, false, nullptr);
  return out;
}

}  // namespace minivllm
