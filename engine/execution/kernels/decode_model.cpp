// A model's decode-only step from token ids to logits in one call and one parallel region (the
// CPU counterpart of a CUDA graph).
//
// The step is a chain of about 180 dependent parts (a layer's QKV projection, attention, output
// projection, gate/up projection, SiLU, down projection, or a sparse layer's router product,
// routed experts' gate/up products, activation, down products and weighted sum; the LM head,
// the argmax). Forking and
// joining the threads around each part costs microseconds a part, and each join leaves the
// memory idle while the next part's threads wake. Here the threads are forked once per step:
// each runs every part, waiting only for the part before to be done (a short spin when all are
// running), and takes tasks of it until none are left. No member waits for another to arrive,
// as at a barrier: one the OS preempts (the server's event loop wants a core) holds the others
// back only while it holds an unfinished task. With a barrier between parts, a batch-1 step
// took several times as long while the service handled a burst of bad requests. The row-wise
// parts between (the norms, the bfloat16 rounding of a product's input and, below 4 rows, SiLU)
// are cheap at a decode step's few rows, so each member computes its own copy rather than wait
// for one more part.
#include "cpu_kernels.h"
#include "layer_parts.h"
#include "quant_tiles.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace minivllm {
namespace {

constexpr int64_t kPanel = 16;  // output channels per panel (packed_weight.py, packed_gemm.cpp)

// A member waiting for a part spins first: a task takes microseconds, and a sleep and wake-up
// would cost more than that. Then it sleeps on a futex, so that a member the OS preempted gets
// a core back instead of watching the others spin: with only a yield after the spin, more
// threads than cores ran the batch-1 step several times slower than forking per part. With
// more ranks than usable CPUs some member is always waiting for a core, so the spin is cut short.
constexpr int64_t kSpins = 1 << 14;  // a few hundred microseconds
constexpr int64_t kShortSpins = 1 << 7;
// How much of its share of the next product a member requests ahead (prefetch_team_home).
constexpr int64_t kNextProductBytes = 8192;
// How much of a layer's K and V rows a few-row step requests ahead (prefetch_kv_rows): a batch-1
// context of 2,730 tokens in bfloat16, 1,365 in float32 (SmolLM2-135M's 3 KV heads of 64).
constexpr int64_t kKvAheadBytes = 2 * 1024 * 1024;

void futex(std::atomic<int32_t>& word, int op, int32_t value) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<int32_t*>(&word), op, value, nullptr, nullptr, 0);
#else
  std::this_thread::yield();
#endif
}

// The CPUs this process may run on (its affinity mask), once.
int64_t usable_cpus() {
#if defined(__linux__)
  static const int64_t count = [] {
    cpu_set_t set;
    return sched_getaffinity(0, sizeof(set), &set) == 0 ? static_cast<int64_t>(CPU_COUNT(&set))
                                                        : static_cast<int64_t>(std::thread::hardware_concurrency());
  }();
  return std::max<int64_t>(1, count);
#else
  return std::max<int64_t>(1, std::thread::hardware_concurrency());
#endif
}

// A part's task counters, a cache line of their own.
struct alignas(64) PartCounter {
  std::atomic<int64_t> next{0}, done{0};
};

// The parts of a layer, in order; then the LM head's and the argmax's. A sparse layer's MLP is
// five parts in place of the dense one's three: the router's product (whose last member routes
// the tokens), the routed experts' gate_up products, their activation, their down products, and
// each token's weighted sum added to the residual stream.
enum LayerPart : int64_t { kQkv, kAttention, kOutput, kGateUp, kSilu, kDown, kPartsPerLayer };
enum SparsePart : int64_t { kRouter = kGateUp, kExpertsGateUp, kExpertsAct, kExpertsDown, kExpertsSum,
                            kPartsPerSparseLayer };
// Each sparse part's kind in the step's split (take_part_seconds): router and experts' gate_up as
// gate_up, the activation as silu, the down products and the sum as down.
constexpr int64_t kSparsePartKinds[kPartsPerSparseLayer] = {kQkv, kAttention, kOutput, kGateUp, kGateUp, kSilu,
                                                            kDown, kDown};

// [begin, end) of n for task `task` of num_tasks: an even split of a row-wise part's elements,
// in whole units of `unit` (the vector width: the same elements take the vector path and the
// same tail the scalar one as in an unsplit row, so the floats match).
inline std::pair<int64_t, int64_t> task_range(int64_t n, int64_t task, int64_t num_tasks, int64_t unit) {
  const int64_t units = (n + unit - 1) / unit;
  return {std::min(n, unit * (units * task / num_tasks)), std::min(n, unit * (units * (task + 1) / num_tasks))};
}

// out[m] = float(table[index[m]]), rows of `width`: the embedding's and RoPE tables' rows of the
// step's tokens (index values checked against the table's rows).
template <typename T>
void gather_rows(const torch::Tensor& table, const int64_t* index, int64_t M, float* out, const char* what) {
  const int64_t rows = table.size(0), width = table.size(1);
  const T* data = table.data_ptr<T>();
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(index[m] >= 0 && index[m] < rows, "DecodeModel.step: ", what, " index ", index[m], " out of [0, ", rows,
                ")");
    const T* row = data + index[m] * width;
    for (int64_t i = 0; i < width; ++i) out[m * width + i] = static_cast<float>(row[i]);
  }
}

torch::Tensor gathered_rows(const torch::Tensor& table, const int64_t* index, int64_t M, const char* what) {
  TORCH_CHECK(table.dim() == 2 && table.is_contiguous(), "DecodeModel.step: ", what, " must be a contiguous 2-D table");
  auto out = torch::empty({M, table.size(1)}, table.options().dtype(torch::kFloat32));
  float* o = out.data_ptr<float>();
  switch (table.scalar_type()) {
    case torch::kFloat32: gather_rows<float>(table, index, M, o, what); break;
    case torch::kBFloat16: gather_rows<at::BFloat16>(table, index, M, o, what); break;
    case torch::kHalf: gather_rows<at::Half>(table, index, M, o, what); break;
    default: TORCH_CHECK(false, "DecodeModel.step: ", what, " must be float32, bfloat16 or float16");
  }
  return out;
}

// A half-width RoPE table's rows at index[0:M] ([max_positions, D / 2] float32: a rotation's
// two halves share their angles) -> [M, D], each row's half written twice, as the layers read it.
torch::Tensor doubled_rope_rows(const torch::Tensor& table, const int64_t* index, int64_t M) {
  const int64_t rows = table.size(0), half = table.size(1);
  auto out = torch::empty({M, 2 * half}, table.options());
  const float* data = table.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(index[m] >= 0 && index[m] < rows, "DecodeModel.step: RoPE table index ", index[m], " out of [0, ",
                rows, ")");
    const float* row = data + index[m] * half;
    std::copy(row, row + half, o + m * 2 * half);
    std::copy(row, row + half, o + m * 2 * half + half);
  }
  return out;
}

// out[m] = the embedding row of index[m] (hidden floats), from a [vocab, hidden] table or, for a
// model whose LM head shares the embedding, from the LM head's own panels: float32 [P, hidden, 16]
// (row t is column t % 16 of panel t / 16) or bfloat16 [P, Kp / 2, 32] (pairs of k interleaved),
// so the embedding is not held a second time.
// A GGUF file's quantized embedding comes as its uint8 block panels (the tied LM head's, or its
// own), each row dequantized as the gguf package does.
// Panels pad the vocabulary to a whole panel: an index past `vocab` would read a padded row.
torch::Tensor gathered_embedding(const torch::Tensor& table, const int64_t* index, int64_t M, int64_t hidden,
                                 int64_t vocab) {
  if (table.dim() == 2) return gathered_rows(table, index, M, "embedding");
  TORCH_CHECK(table.dim() == 3 && table.is_contiguous(), "DecodeModel.step: embedding panels must be contiguous");
  const int64_t rows = std::min(table.size(0) * kPanel, vocab), inner = table.size(1);
  auto out = torch::empty({M, hidden}, table.options().dtype(torch::kFloat32));
  float* o = out.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    TORCH_CHECK(index[m] >= 0 && index[m] < rows, "DecodeModel.step: embedding index ", index[m], " out of [0, ",
                rows, ")");
  if (table.scalar_type() == torch::kByte) {
    quant_gather_rows(QuantPanels::of(table, quant_type_of_record(table.size(2))), index, M, hidden, o);
    return out;
  }
  for (int64_t m = 0; m < M; ++m) {
    const int64_t panel = index[m] / kPanel, lane = index[m] % kPanel;
    if (table.scalar_type() == torch::kFloat32) {
      const float* p = table.data_ptr<float>() + panel * inner * kPanel + lane;
      for (int64_t i = 0; i < hidden; ++i) o[m * hidden + i] = p[i * kPanel];
    } else {
      const at::BFloat16* p = table.data_ptr<at::BFloat16>() + panel * inner * 2 * kPanel + 2 * lane;
      for (int64_t i = 0; i < hidden; ++i) o[m * hidden + i] = static_cast<float>(p[(i / 2) * 2 * kPanel + i % 2]);
    }
  }
  return out;
}

// x *= scale as torch multiplies an embedding of scale's dtype by it: each value in that dtype
// (a float32 gather of bfloat16 rows is exact; a GGUF row's dequantized floats are rounded to it
// first, as the torch path's lookup returns them), times the scale, rounded to the dtype.
template <typename T>
void scale_rows(float* x, int64_t n, float factor) {
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(static_cast<T>(static_cast<float>(static_cast<T>(x[i])) * factor));
}

void scale_embedding(torch::Tensor& x, const torch::Tensor& scale) {
  float* p = x.data_ptr<float>();
  const int64_t n = x.numel();
  switch (scale.scalar_type()) {
    case torch::kBFloat16: return scale_rows<at::BFloat16>(p, n, static_cast<float>(scale.item<at::BFloat16>()));
    case torch::kHalf: return scale_rows<at::Half>(p, n, static_cast<float>(scale.item<at::Half>()));
    default: {
      const float factor = scale.item<float>();
      for (int64_t i = 0; i < n; ++i) p[i] *= factor;
    }
  }
}

// The index of row[0:n]'s first maximum, a NaN counting as one (the first NaN wins), as
// torch.argmax. One pass, scalar: the first NaN ends it.
int64_t first_argmax_scalar(const float* row, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (row[i] != row[i]) return i;
    if (row[i] > row[best]) best = i;
  }
  return best;
}

#if defined(__x86_64__)
// The same on AVX-512: the maximum and any NaN over 32 lanes a step, then the first lane equal
// to it (or the first NaN). Intrinsics, not `#pragma omp simd`: the compiler left such passes
// scalar.
__attribute__((target("avx512f"))) int64_t first_argmax_avx512(const float* row, int64_t n) {
  __m512 best0 = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), best1 = best0;
  __mmask16 nan0 = 0, nan1 = 0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 a = _mm512_loadu_ps(row + i), b = _mm512_loadu_ps(row + i + 16);
    best0 = _mm512_max_ps(best0, a);
    best1 = _mm512_max_ps(best1, b);
    nan0 |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
    nan1 |= _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q);
  }
  float best = _mm512_reduce_max_ps(_mm512_max_ps(best0, best1));
  bool has_nan = (nan0 | nan1) != 0;
  for (int64_t j = i; j < n; ++j) {
    has_nan |= row[j] != row[j];
    best = row[j] > best ? row[j] : best;
  }
  const __m512 target = _mm512_set1_ps(best);
  for (i = 0; i + 16 <= n; i += 16) {
    const __m512 a = _mm512_loadu_ps(row + i);
    const __mmask16 hit = has_nan ? _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(a, target, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  for (; i < n; ++i) {
    if (has_nan ? row[i] != row[i] : row[i] == best) return i;
  }
  return 0;  // every value -inf: the first
}
#endif

int64_t first_argmax(const float* row, int64_t n, int64_t isa) {
#if defined(__x86_64__)
  if (isa >= kIsaAvx512) return first_argmax_avx512(row, n);
#endif
  return first_argmax_scalar(row, n);
}

// A product as its members read it.
struct ProductPlan {
  PackedPanels w;
  const float *scale, *bias;
  int64_t n;

  static ProductPlan of(const PackedLinear& linear) {
    const LinearView l = view(linear);
    return {PackedPanels::of(l.w), l.scale, l.bias, l.n};
  }
};

// A layer as its members read it: a few cache lines, requested ahead with its norm weights
// while the layer before runs (prefetch_lines), not each tensor's fields (a chain of misses per
// tensor, about ten tensors a layer).
struct alignas(64) LayerPlan {
  const float *input_norm, *post_norm;  // [hidden] each
  ProductPlan qkv, o_proj, gate_up, down;
  KvCacheView cache;
  int64_t window;
  int64_t rope;  // the step's RoPE rows it reads (DecodeLayerWeights' rope_index)
  // The families' norms beyond Llama's, nullptr where the layer has none: per head of q and k
  // ([D] each), of o_proj's and down's outputs ([hidden] each).
  const float *q_norm, *k_norm, *attn_output_norm, *mlp_output_norm;
  int64_t group;  // its KV-cache group: which of the step's block tables and slots it reads
  const float* sinks;  // [num_heads] each query head's sink logit (gpt-oss), or nullptr
  // A sparse layer's MLP (experts nullptr: a dense layer): its router's panels, its experts, its
  // routing, and its index among the sparse layers (its MoeRows).
  const MoeExperts* experts;
  ProductPlan router;
  int64_t top_k, routing;
  bool norm_topk_prob;
  int64_t sparse;
};

// x[m] += RMSNorm(y[m]) for the step's rows (add_rms_normed), run by the member that ends a
// product whose output the layer norms (TeamShare::finish): Gemma's residual add, with no part
// of its own.
struct ResidualNorm {
  float* y;  // [M, width]: the product; overwritten by its norm
  int64_t M, width;
  const float* weight;
  float eps;
  float* x;  // [M, width]: the residual stream

  static void run(const void* self) {
    const auto& r = *static_cast<const ResidualNorm*>(self);
    add_rms_normed(r.y, r.M, r.width, r.weight, r.eps, r.x);
  }
};

// Requests [p, p + bytes) into L2; a no-op off x86.
inline void prefetch_lines(const void* p, int64_t bytes) {
#if defined(__x86_64__)
  for (int64_t offset = 0; offset < bytes; offset += 64) _mm_prefetch(static_cast<const char*>(p) + offset, _MM_HINT_T1);
#endif
}

}  // namespace

struct DecodeModel::Plan {
  std::vector<LayerPlan> layers;
  ProductPlan head;
  const float* final_norm;  // [hidden]
  std::vector<int64_t> part_begin;  // [layers + 1]: each layer's first part, then the LM head's
  std::vector<int64_t> part_kinds;  // [part_begin.back()]: each layer part's kind in the step's split
  // The sparse layers': their count, and the widest routing and experts (the step's scratch).
  int64_t num_sparse = 0, max_top_k = 0, max_experts = 0, max_moe_intermediate = 0;
  // [num_sparse]: a step's routes per sparse layer, rewritten each step (steps run one at a time).
  // One per layer, not one for all: a late member (see run_member) may still read a layer's task
  // count after the team has moved on, and must find that layer's.
  mutable std::vector<MoeRows> moe_rows;
};

namespace {

// What a step's team shares: its inputs, the activations its members write and read, a counter
// for each part, and how far the step has got.
struct TeamStep {
  const DecodeModel& model;
  const DecodeModel::Plan& plan;
  int64_t M, num_ranks;
  float* x;        // [M, hidden]: the residual stream
  float* qkv;      // [M, q | k | v]
  float* attn;     // [M, q_size]
  float* gate_up;  // [M, 2 * intermediate]
  float* act;      // [M, intermediate]; below 4 rows [num_ranks, M, intermediate], each member's own
  float* logits;   // [M, vocab]
  int64_t* ids;    // [M], or nullptr: no argmax
  float* norms;    // [num_ranks, M, hidden]: each member's own normed rows
  float* product;  // [M, hidden]: o_proj's or down's output where a layer norms it; else unused
  const std::vector<const float*>& cos;  // per rope, [M, D]
  const std::vector<const float*>& sin;
  const int64_t *tables, *lens, *slots;  // [groups, M, max_blocks], [M], [groups, M]
  int64_t max_blocks;
  const DecodeAttentionTasks& attention_tasks;
  PartCounter* counters;  // [parts]
  HomeRange* homes;       // [parts, num_ranks]
  TeamProgress progress;
  // The sparse layers' (R = M * top_k rows, each a token's route to one expert, grouped by
  // expert): the router's logits [M, E]; the experts' input rows [R, hidden] and, for GGUF block
  // panels, their quantized copy; gate_up's outputs [R, 2 I]; the activations [R, I] and their
  // quantized copy; the experts' outputs [R, hidden]; each token's weighted sum [M, hidden].
  float *router_logits, *moe_xs, *moe_h, *moe_a, *moe_y, *moe_sum;
  int8_t *moe_xs_q, *moe_a_q;
  BlockActs *moe_xs_blocks, *moe_a_blocks;
};

// A sparse layer's routing, run by the member that ends its router product (TeamShare::finish)
// while the others wait for the part: each token's k experts and weights as the per-layer kernel
// routes them (route_tokens), grouped into rows and each product's tasks (MoeExperts::group), and
// the experts' input rows gathered from that member's normed rows (quantized for GGUF block
// panels). A few microseconds at a decode step's rows: less than one more part's hand-over.
struct RouteExperts {
  const LayerPlan* layer;
  MoeRows* rows;
  const float* logits;  // [M, E]
  const float* h;       // [M, hidden]: the finishing member's normed rows
  int64_t M, hidden, num_ranks;
  float* xs;            // [M top_k, hidden]
  int8_t* q;            // [M top_k, hidden]
  BlockActs* blocks;    // [M top_k, hidden / 32]

  static void run(const void* self) {
    const auto& r = *static_cast<const RouteExperts*>(self);
    const LayerPlan& l = *r.layer;
    MoeRows& rows = *r.rows;
    const int64_t k = l.top_k, R = r.M * k, H = r.hidden;
    rows.ids.resize(R);
    rows.weights.resize(R);
    route_tokens(r.logits, r.M, l.router.n, k, l.routing, l.norm_topk_prob, rows.ids.data(), rows.weights.data());
    l.experts->group(rows.ids.data(), rows.weights.data(), r.M, k, r.num_ranks, rows);
    for (int64_t row = 0; row < R; ++row) std::copy_n(r.h + rows.row_token[row] * H, H, r.xs + row * H);
    if (l.experts->quantizes_gate_up_input()) l.experts->quantize(r.xs, R, H, r.q, r.blocks);
  }
};

// Below kFewRows rows a task first requests into L2 the cached K and V rows it reads (all but
// the new one, which it writes, up to kKvAheadBytes in all), all at once: the layer's request
// after the QKV product (prefetch_kv_rows) had not brought them all in (the attention part ran
// far faster over rows that a run just before had left in the caches). The same request made in
// a function of its own measured no faster than none (not understood).
// One sequence's RoPE of the query heads of KV heads [kv_begin, kv_end) and of those K heads,
// their K and V rows written at the token's slot, and their attention.
template <typename cache_t>
void attend_task(const TeamStep& s, int64_t m, int64_t kv_begin, int64_t kv_end, int64_t layer,
                 std::vector<float>& scratch) {
  const DecodeModel& model = s.model;
  const LayerPlan& plan = s.plan.layers[layer];
  const int64_t D = model.head_dim, q_size = model.num_heads * D, kv_size = model.num_kv_heads * D;
  const int64_t group = model.num_heads / model.num_kv_heads;
  float* row = s.qkv + m * model.qkv_width;  // q | k | v
  const float* cos = s.cos[plan.rope] + m * D;
  const float* sin = s.sin[plan.rope] + m * D;
#if defined(__x86_64__)
  if (s.M < kFewRows) {  // the K and V rows this task reads, all but the new one (see above)
    const int64_t element = plan.cache.element_size(), row_bytes = plan.cache.row_bytes();
    const char* k = static_cast<const char*>(plan.cache.k) + kv_begin * D * element;
    const char* v = static_cast<const char*>(plan.cache.v) + kv_begin * D * element;
    // Capped as the layer's request is (kKvAheadBytes): rows past what L2 holds would evict
    // the first ones before the attention reads them.
    const int64_t bytes = (kv_end - kv_begin) * D * element;
    const int64_t cached = std::min(s.lens[m] - 1, kKvAheadBytes / 2 / bytes);
    const int64_t* table = s.tables + (plan.group * s.M + m) * s.max_blocks;
    for (int64_t t = 0; t < cached; ++t) {
      const int64_t slot = paged_slot(table, model.block_size, t);
      for (int64_t line = 0; line < bytes; line += 64) {
        _mm_prefetch(k + slot * row_bytes + line, _MM_HINT_T1);
        _mm_prefetch(v + slot * row_bytes + line, _MM_HINT_T1);
      }
    }
  }
#endif
  if (plan.q_norm != nullptr) {  // this task's heads of q and k, each normed once
    const auto eps = static_cast<float>(model.eps);
    for (int64_t h = kv_begin * group; h < kv_end * group; ++h) rms_norm_row(row + h * D, D, plan.q_norm, eps, row + h * D);
    for (int64_t h = kv_begin; h < kv_end; ++h)
      rms_norm_row(row + q_size + h * D, D, plan.k_norm, eps, row + q_size + h * D);
  }
  rope(row + kv_begin * group * D, (kv_end - kv_begin) * group, D, cos, sin);
  rope(row + q_size + kv_begin * D, kv_end - kv_begin, D, cos, sin);
  const int64_t offset = kv_begin * D, count = (kv_end - kv_begin) * D;
  const int64_t slot = s.slots[plan.group * s.M + m];
  write_cache(static_cast<cache_t*>(plan.cache.k), slot, kv_size, offset, row + q_size + offset, count);
  write_cache(static_cast<cache_t*>(plan.cache.v), slot, kv_size, offset, row + q_size + kv_size + offset, count);
  attend_decode_row(row, plan.cache, s.tables + (plan.group * s.M + m) * s.max_blocks, s.lens[m], model.block_size,
                    static_cast<float>(model.scale), plan.window, model.num_heads, s.attn + m * q_size,
                    scratch, kv_begin, kv_end, model.isa, plan.sinks);
}

// Requests into L2 the K and V rows a few-row step's attention reads in `layer` (all but each
// sequence's new row, which the step writes): after a step's weights stream through the caches
// they come from memory, and the attention part, a chain of dependent misses walking the block
// table, was mostly waiting on them. Asked for as a member's tasks of the layer's QKV product
// end, they arrive while the part ends and attention starts. At a 1,500-token context (1.15 MB
// a layer) the whole request still paid more than one capped at 256 KB. Longer contexts are
// capped at kKvAheadBytes, the rows in the attention's order, untried beyond.
void prefetch_kv_rows(const TeamStep& s, int64_t layer) {
#if defined(__x86_64__)
  const DecodeModel& model = s.model;
  const KvCacheView& cache = s.plan.layers[layer].cache;
  const int64_t* tables = s.tables + s.plan.layers[layer].group * s.M * s.max_blocks;
  const int64_t row_bytes = cache.row_bytes();
  const char* k = static_cast<const char*>(cache.k);
  const char* v = static_cast<const char*>(cache.v);
  int64_t budget = kKvAheadBytes / 2;  // of K's rows, and as much of V's
  for (int64_t m = 0; m < s.M && budget > 0; ++m) {
    const int64_t cached = s.lens[m] - 1;
    for (int64_t b = 0; b * model.block_size < cached && budget > 0; ++b) {
      const int64_t first = tables[m * s.max_blocks + b] * model.block_size * row_bytes;
      const int64_t bytes = std::min(budget, std::min(model.block_size, cached - b * model.block_size) * row_bytes);
      for (int64_t offset = 0; offset < bytes; offset += 64) {
        _mm_prefetch(k + first + offset, _MM_HINT_T1);
        _mm_prefetch(v + first + offset, _MM_HINT_T1);
      }
      budget -= bytes;
    }
  }
#endif
}

// A member's run of a sparse layer's MLP parts (after its o_proj): the router's product on its
// own normed rows h (the member ending it routes: RouteExperts), the routed experts' gate_up
// products in MoeExperts::group's tasks (the per-layer kernel's own, so each output's floats are
// the same), the activation in row ranges (each range's rows quantized for GGUF down panels), the
// down products, and each token's weighted sum (MoeExperts::sum_token) added to the residual
// stream, as decode_layer adds it: the sum, then the add (or the sum's norm and add, where the
// layer norms its MLP's output).
void run_sparse_mlp(TeamStep& s, const LayerPlan& w, int64_t part, int64_t rank_begin, float* h) {
  const DecodeModel& model = s.model;
  const int64_t M = s.M, hidden = model.hidden, isa = model.isa;
  const auto eps = static_cast<float>(model.eps);
  const MoeExperts& experts = *w.experts;
  MoeRows& rows = s.plan.moe_rows[w.sparse];
  const auto share = [&](int64_t p, bool home_ranges = false) {
    return TeamShare{s.num_ranks, &s.counters[p].next, &s.counters[p].done, &s.progress, p,
                     home_ranges ? s.homes + p * s.num_ranks : nullptr, rank_begin};
  };
  if (s.progress.wait_for(part + kRouter)) {
    rms_norm(s.x, M, hidden, w.post_norm, eps, h);
    const RouteExperts route{&w, &rows, s.router_logits, h, M, hidden, s.num_ranks, s.moe_xs, s.moe_xs_q,
                             s.moe_xs_blocks};
    TeamShare team = share(part + kRouter, true);
    team.finish = &RouteExperts::run;
    team.finish_arg = &route;
    packed_gemm(h, M, hidden, hidden, w.router.w, w.router.scale, w.router.bias, w.router.n, s.router_logits,
                w.router.n, isa, false, &team);
  }
  const int64_t I = experts.intermediate(), R = M * w.top_k;
  if (s.progress.wait_for(part + kExpertsGateUp)) {
    const QuantActs acts{s.moe_xs_q, s.moe_xs_blocks, hidden, hidden / 32};
    share(part + kExpertsGateUp, true).for_each_task(static_cast<int64_t>(rows.gate_up_tasks.size()),
        [&](int64_t task) { experts.run_gate_up_task(rows, task, s.moe_xs, acts, s.moe_h); });
  }
  if (s.progress.wait_for(part + kExpertsAct)) {
    const int64_t num_tasks = std::min(R, 4 * s.num_ranks);
    const bool quantize = experts.quantizes_down_input();
    share(part + kExpertsAct).for_each_task(num_tasks, [&](int64_t task) {
      const auto [r0, r1] = task_range(R, task, num_tasks, 1);
      experts.activate(s.moe_h, r0, r1, s.moe_a);
      if (quantize) experts.quantize(s.moe_a + r0 * I, r1 - r0, I, s.moe_a_q + r0 * I, s.moe_a_blocks + r0 * (I / 32));
    });
  }
  if (s.progress.wait_for(part + kExpertsDown)) {
    const QuantActs acts{s.moe_a_q, s.moe_a_blocks, I, I / 32};
    share(part + kExpertsDown, true).for_each_task(static_cast<int64_t>(rows.down_tasks.size()),
        [&](int64_t task) { experts.run_down_task(rows, task, s.moe_a, acts, s.moe_y); });
  }
  if (s.progress.wait_for(part + kExpertsSum)) {
    if (w.mlp_output_norm != nullptr) {  // whole rows: the norm reads all of one
      share(part + kExpertsSum).for_each_task(M, [&](int64_t t) {
        float* y = s.moe_sum + t * hidden;
        experts.sum_token(rows, s.moe_y, t, 0, hidden, y);
        add_rms_normed(y, 1, hidden, w.mlp_output_norm, eps, s.x + t * hidden);
      });
      return;
    }
    // column ranges of whole vector widths, about four tasks a member
    const int64_t per_row = std::max<int64_t>(1, std::min((hidden + 15) / 16, (4 * s.num_ranks + M - 1) / M));
    share(part + kExpertsSum).for_each_task(M * per_row, [&](int64_t task) {
      const int64_t t = task / per_row;
      const auto [c0, c1] = task_range(hidden, task % per_row, per_row, 16);
      float* y = s.moe_sum + t * hidden;
      float* x = s.x + t * hidden;
      experts.sum_token(rows, s.moe_y, t, c0, c1, y);
      for (int64_t i = c0; i < c1; ++i) x[i] += y[i];
    });
  }
}

// One member's run of the whole step, as ranks [rank_begin, rank_end) of the team (its own
// norm rows). Before each part it waits for the part before, then takes tasks until none are
// left; a part already done (this member was preempted meanwhile) it skips. A member's own
// copy of a part's input (the norms; packed_gemm's bfloat16 rounding) may be read while a later
// part overwrites the source, but is then never used: taking a task of the part proves the
// part was not done, so no later part had started. Nothing here throws (the constructor checked
// what could): the others would wait for ever for a task it held.
void run_member(TeamStep& s, int64_t rank_begin) {
  const DecodeModel& model = s.model;
  const int64_t M = s.M, hidden = model.hidden, isa = model.isa;
  const int64_t q_size = model.num_heads * model.head_dim, intermediate = model.intermediate;
  const auto eps = static_cast<float>(model.eps);
  const bool fp32_cache = s.plan.layers.front().cache.is_fp32;
  float* h = s.norms + rank_begin * M * hidden;  // [M, hidden], this member's own
  std::vector<float> scratch;
  // Products walk home ranges (each member's weights one run of memory); the other parts take
  // tasks from the shared counter: attention's come longest first, so whoever is free takes the
  // next longest and the team ends on the shortest.
  const auto share = [&](int64_t part, bool home_ranges = false) {
    return TeamShare{s.num_ranks, &s.counters[part].next, &s.counters[part].done, &s.progress, part,
                     home_ranges ? s.homes + part * s.num_ranks : nullptr, rank_begin};
  };
  const auto gemm = [&](const ProductPlan& l, const float* x, int64_t K, float* out, bool accumulate, int64_t part,
                        const ResidualNorm* finish = nullptr) {
    TeamShare team = share(part, true);
    if (finish != nullptr) {
      team.finish = &ResidualNorm::run;
      team.finish_arg = finish;
    }
    packed_gemm(x, M, K, K, l.w, l.scale, l.bias, l.n, out, l.n, isa, accumulate, &team);
  };
  // A product whose output joins the residual stream: added by the product itself, or (a layer
  // that norms it) written apart, then normed and added by the member that ends the product.
  const auto residual_gemm = [&](const ProductPlan& l, const float* x, int64_t K, const float* output_norm,
                                 int64_t part) {
    if (output_norm == nullptr) return gemm(l, x, K, s.x, true, part);
    const ResidualNorm finish{s.product, M, hidden, output_norm, eps, s.x};
    gemm(l, x, K, s.product, false, part, &finish);
  };
  const int64_t act_kind = model.act;
  // Below kFewRows rows (memory-bound products, short attention): as a member finishes its tasks of a
  // product it requests the start of its share of the next one, and once its tasks of a layer's
  // QKV product are done, the layer's K and V rows (after the product, not as the layer starts,
  // so the requests do not hold up the product's first task).
  const bool few_rows = M < kFewRows;
  const auto prefetch_next = [&](const ProductPlan& next) {
    if (few_rows) prefetch_team_home(next.w, s.num_ranks, rank_begin, kNextProductBytes);
  };
  // SiLU in tasks of whole vector widths, so every float takes the per-layer kernel's path. Below
  // 4 rows the part has no tasks: each member computes the whole SiLU into its own copy of down's
  // input, so down's rows never cross between cores and a hand-over a layer goes.
  const int64_t silu_tasks = few_rows ? 0 : std::min<int64_t>((intermediate + 15) / 16, 4 * s.num_ranks);
  float* act = few_rows ? s.act + rank_begin * M * intermediate : s.act;  // down's input
  const int64_t num_layers = static_cast<int64_t>(s.plan.layers.size());
  // A layer's last part done: its successor's weights requested ahead.
  const auto prefetch_after_layer = [&](int64_t layer) {
    if (layer + 1 < num_layers) {
      const LayerPlan& next = s.plan.layers[layer + 1];
      prefetch_next(next.qkv);
      if (few_rows) {
        prefetch_lines(&next, sizeof(LayerPlan));
        prefetch_lines(next.input_norm, hidden * 4);
      }
    } else {
      prefetch_next(s.plan.head);
      if (few_rows) prefetch_lines(s.plan.final_norm, hidden * 4);
    }
  };
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const LayerPlan& w = s.plan.layers[layer];
    const int64_t part = s.plan.part_begin[layer];
    if (s.progress.wait_for(part + kQkv)) {
      rms_norm(s.x, M, hidden, w.input_norm, eps, h);
      gemm(w.qkv, h, hidden, s.qkv, false, part + kQkv);
      if (few_rows) prefetch_kv_rows(s, layer);
      prefetch_next(w.o_proj);
    }
    if (s.progress.wait_for(part + kAttention)) {
      share(part + kAttention).for_each_task(s.attention_tasks.size(), [&](int64_t task) {
        const auto [first, num_rows, kv_begin] = s.attention_tasks[task];
        const int64_t kv_end = kv_begin + s.attention_tasks.heads_per_task();
        for (int64_t m = first; m < first + num_rows; ++m)  // a chain's rows in order (see DecodeAttentionTasks)
          fp32_cache ? attend_task<float>(s, m, kv_begin, kv_end, layer, scratch)
                     : attend_task<at::BFloat16>(s, m, kv_begin, kv_end, layer, scratch);
      });
    }
    if (s.progress.wait_for(part + kOutput)) {
      residual_gemm(w.o_proj, s.attn, q_size, w.attn_output_norm, part + kOutput);
      prefetch_next(w.experts != nullptr ? w.router : w.gate_up);
      if (few_rows) prefetch_lines(w.post_norm, hidden * 4);
    }
    if (w.experts != nullptr) {
      run_sparse_mlp(s, w, part, rank_begin, h);
      prefetch_after_layer(layer);
      continue;
    }
    if (s.progress.wait_for(part + kGateUp)) {
      rms_norm(s.x, M, hidden, w.post_norm, eps, h);
      gemm(w.gate_up, h, hidden, s.gate_up, false, part + kGateUp);
      prefetch_next(w.down);
    }
    if (s.progress.wait_for(part + kSilu)) {
      share(part + kSilu).for_each_task(silu_tasks, [&](int64_t task) {
        const auto [c0, c1] = task_range(intermediate, task, silu_tasks, 16);
        for (int64_t m = 0; m < M; ++m) {
          const float* g = s.gate_up + m * 2 * intermediate;
          gated_act(g + c0, g + intermediate + c0, s.act + m * intermediate + c0, c1 - c0, act_kind, isa);
        }
      });
    }
    if (s.progress.wait_for(part + kDown)) {
      if (few_rows)
        for (int64_t m = 0; m < M; ++m) {
          const float* g = s.gate_up + m * 2 * intermediate;
          gated_act(g, g + intermediate, act + m * intermediate, intermediate, act_kind, isa);
        }
      residual_gemm(w.down, act, intermediate, w.mlp_output_norm, part + kDown);
      prefetch_after_layer(layer);
    }
  }
  const int64_t head_part = s.plan.part_begin[num_layers];
  if (s.progress.wait_for(head_part)) {
    rms_norm(s.x, M, hidden, s.plan.final_norm, eps, h);
    gemm(s.plan.head, h, hidden, s.logits, false, head_part);
  }
  if (s.ids == nullptr || !s.progress.wait_for(head_part + 1)) return;
  const int64_t vocab = s.plan.head.n;
  share(head_part + 1).for_each_task(M, [&](int64_t m) { s.ids[m] = first_argmax(s.logits + m * vocab, vocab, isa); });
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

void TeamProgress::complete(int64_t part) {
  if (stamps_ != nullptr) stamps_[part] = now_ns();
  parts_done_.store(static_cast<int32_t>(part + 1));  // seq_cst, then sleepers_: a sleeper sees it or is woken
  if (sleepers_.load() > 0) futex(parts_done_, FUTEX_WAKE_PRIVATE, INT32_MAX);
}

bool TeamProgress::wait_for(int64_t part) {
  int32_t done = parts_done_.load(std::memory_order_acquire);
  for (int64_t spins = 0; done < part && spins < max_spins_; ++spins) {
#if defined(__x86_64__)
    _mm_pause();
#endif
    done = parts_done_.load(std::memory_order_acquire);
  }
  if (done < part) {
    sleepers_.fetch_add(1);
    while ((done = parts_done_.load()) < part) futex(parts_done_, FUTEX_WAIT_PRIVATE, done);  // returns if it moved
    sleepers_.fetch_sub(1);
  }
  return done == part;
}

DecodeModel::DecodeModel(torch::Tensor embedding, std::vector<torch::Tensor> rope_cos,
                         std::vector<torch::Tensor> rope_sin, std::vector<std::shared_ptr<DecodeLayerWeights>> layers,
                         std::vector<std::tuple<torch::Tensor, torch::Tensor>> kv_caches, torch::Tensor final_norm,
                         PackedLinear lm_head, int64_t num_heads, int64_t block_size, double eps, double scale,
                         int64_t act, std::optional<torch::Tensor> embed_scale, int64_t isa,
                         std::vector<int64_t> layer_groups)
    : embedding(std::move(embedding)), rope_cos(std::move(rope_cos)), rope_sin(std::move(rope_sin)),
      layers(std::move(layers)), kv_caches(std::move(kv_caches)), final_norm(std::move(final_norm)),
      lm_head(std::move(lm_head)), num_heads(num_heads), block_size(block_size), eps(eps), scale(scale), act(act),
      embed_scale(std::move(embed_scale)), isa(isa), layer_groups(std::move(layer_groups)) {
  // Everything a step's team could trip over is checked here: a member must not throw.
  TORCH_CHECK(isa <= best_isa(), "DecodeModel: this CPU lacks the requested instruction set");
  TORCH_CHECK(!this->layers.empty() && this->kv_caches.size() == this->layers.size(),
              "DecodeModel: one (K, V) cache pair per layer, at least one layer");
  TORCH_CHECK(!this->rope_cos.empty() && this->rope_cos.size() == this->rope_sin.size(),
              "DecodeModel: one cos and one sin table per rope, at least one");
  for (size_t r = 0; r < this->rope_cos.size(); ++r) {
    const auto &c = this->rope_cos[r], &sn = this->rope_sin[r];
    TORCH_CHECK(c.scalar_type() == torch::kFloat32 && sn.scalar_type() == torch::kFloat32 && c.dim() == 2 &&
                c.is_contiguous() && sn.is_contiguous() && c.sizes() == sn.sizes() &&
                c.size(1) == this->rope_cos.front().size(1),
                "DecodeModel: contiguous float32 RoPE tables of one width, cos and sin of one shape");
  }
  TORCH_CHECK(act == kActSilu || act == kActGeluTanh, "DecodeModel: unknown activation ", act);
  if (this->embed_scale) {
    const auto type = this->embed_scale->scalar_type();
    TORCH_CHECK(this->embed_scale->numel() == 1 &&
                (type == torch::kFloat32 || type == torch::kBFloat16 || type == torch::kHalf),
                "DecodeModel: embed_scale must be one float32, bfloat16 or float16 value");
  }
  TORCH_CHECK(this->layer_groups.size() == this->layers.size(), "DecodeModel: one KV-cache group per layer");
  num_groups = 0;
  for (const int64_t g : this->layer_groups) {
    TORCH_CHECK(g >= 0 && g < static_cast<int64_t>(this->layers.size()), "DecodeModel: KV-cache group ", g,
                " out of range");
    num_groups = std::max(num_groups, g + 1);
  }
  TORCH_CHECK(this->final_norm.scalar_type() == torch::kFloat && this->final_norm.dim() == 1 &&
              this->final_norm.is_contiguous(), "DecodeModel: final_norm must be [hidden] float32");
  TORCH_CHECK(num_heads > 0 && block_size > 0, "DecodeModel: num_heads and block_size must be positive");
  hidden = this->final_norm.numel();
  const auto& e = this->embedding;
  const bool is_table = e.dim() == 2;
  TORCH_CHECK(!is_table || e.size(1) == hidden, "DecodeModel: final_norm must be [hidden] float32, hidden the "
              "embedding's width");
  const bool is_fp32_panels = e.dim() == 3 && e.scalar_type() == torch::kFloat32 && e.size(1) == hidden &&
                              e.size(2) == kPanel;
  const bool is_bf16_panels = e.dim() == 3 && e.scalar_type() == torch::kBFloat16 && 2 * e.size(1) >= hidden &&
                              e.size(2) == 2 * kPanel;
  const bool is_quant_panels = e.dim() == 3 && e.scalar_type() == torch::kByte && e.is_contiguous() &&
                               quant_type_of_record(e.size(2)) != 0 &&
                               e.size(1) * quant_format(quant_type_of_record(e.size(2))).record_k() == hidden;
  TORCH_CHECK(is_table || is_fp32_panels || is_bf16_panels || is_quant_panels,
              "DecodeModel: the embedding must be [vocab, hidden], the LM head's float32 or bfloat16 panels or GGUF "
              "block panels of hidden inputs");
  head_dim = 2 * this->rope_cos.front().size(1);  // the tables hold each angle once
  const auto& k0 = std::get<0>(this->kv_caches.front());
  TORCH_CHECK(k0.dim() == 3 && k0.size(2) == head_dim && k0.size(1) > 0 && num_heads % k0.size(1) == 0,
              "DecodeModel: caches must be [slots, KV heads, head_dim], the KV heads dividing num_heads");
  num_kv_heads = k0.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  qkv_width = q_size + 2 * kv_size;
  intermediate = 0;  // the first dense layer's MLP width
  for (const auto& l : this->layers) {
    if (!l->moe) {
      intermediate = std::get<3>(l->gate_up) / 2;
      break;
    }
  }
  for (size_t i = 0; i < this->layers.size(); ++i) {
    const DecodeLayerWeights& l = *this->layers[i];
    const auto& [k, v] = this->kv_caches[i];
    TORCH_CHECK(k.sizes() == k0.sizes() && v.sizes() == k0.sizes() && k.scalar_type() == k0.scalar_type() &&
                v.scalar_type() == k0.scalar_type() && k.is_contiguous() && v.is_contiguous(),
                "DecodeModel: every layer's K and V caches contiguous, of one shape and dtype");
    TORCH_CHECK(k.scalar_type() == torch::kFloat32 || k.scalar_type() == torch::kBFloat16,
                "DecodeModel: float32 or bfloat16 caches");
    for (const auto* norm : {&l.input_norm, &l.post_norm})
      TORCH_CHECK(norm->scalar_type() == torch::kFloat32 && norm->numel() == hidden && norm->is_contiguous(),
                  "DecodeModel: layer ", i, "'s norms must be [hidden] float32");
    for (const auto* norm : {&l.attn_output_norm, &l.mlp_output_norm})
      TORCH_CHECK(!*norm || ((*norm)->scalar_type() == torch::kFloat32 && (*norm)->numel() == hidden &&
                             (*norm)->is_contiguous()), "DecodeModel: layer ", i, "'s output norms must be [hidden] float32");
    TORCH_CHECK(l.q_norm.has_value() == l.k_norm.has_value(), "DecodeModel: layer ", i, "'s q_norm and k_norm come together");
    for (const auto* norm : {&l.q_norm, &l.k_norm})
      TORCH_CHECK(!*norm || ((*norm)->scalar_type() == torch::kFloat32 && (*norm)->numel() == head_dim &&
                             (*norm)->is_contiguous()), "DecodeModel: layer ", i, "'s q/k norms must be [head_dim] float32");
    TORCH_CHECK(l.rope_index >= 0 && l.rope_index < static_cast<int64_t>(this->rope_cos.size()),
                "DecodeModel: layer ", i, "'s rope_index ", l.rope_index, " names no RoPE table");
    TORCH_CHECK(std::get<3>(l.qkv) == qkv_width && std::get<3>(l.o_proj) == hidden &&
                (l.moe || (std::get<3>(l.gate_up) == 2 * intermediate && std::get<3>(l.down) == hidden)),
                "DecodeModel: layer ", i, "'s projection widths");
    std::vector<std::pair<const PackedLinear*, int64_t>> inputs = {{&l.qkv, hidden}, {&l.o_proj, q_size}};
    if (l.moe) {
      const MoeMlp& moe = *l.moe;
      TORCH_CHECK(moe.experts && moe.experts->hidden() == hidden && std::get<3>(moe.router) == moe.experts->num_experts(),
                  "DecodeModel: layer ", i, "'s router must have one output per expert, its experts hidden wide");
      TORCH_CHECK(moe.top_k >= 1 && moe.top_k <= moe.experts->num_experts() &&
                  (moe.routing == kRoutingSoftmaxTopk || moe.routing == kRoutingTopkSoftmax),
                  "DecodeModel: layer ", i, "'s routing: top_k in 1..experts, a known routing");
      inputs.emplace_back(&moe.router, hidden);
    } else {
      inputs.insert(inputs.end(), {{&l.gate_up, hidden}, {&l.down, intermediate}});
    }
    for (const auto& [linear, K] : inputs) {
      const LinearView lv = view(*linear);
      check_packed_weight(lv.w, K, lv.n, lv.scale, isa);
    }
  }
  const LinearView head = view(this->lm_head);
  check_packed_weight(head.w, hidden, head.n, head.scale, isa);
  auto plan = std::make_shared<Plan>();
  const auto pointer = [](const std::optional<torch::Tensor>& t) { return t ? t->data_ptr<float>() : nullptr; };
  has_output_norms = false;
  plan->part_begin.push_back(0);
  for (size_t i = 0; i < this->layers.size(); ++i) {
    const DecodeLayerWeights& l = *this->layers[i];
    const auto& [k, v] = this->kv_caches[i];
    const bool is_sparse = static_cast<bool>(l.moe);
    // A sparse layer's gate_up and down are empty: their plans are never read.
    plan->layers.push_back({l.input_norm.data_ptr<float>(), l.post_norm.data_ptr<float>(), ProductPlan::of(l.qkv),
                            ProductPlan::of(l.o_proj), is_sparse ? ProductPlan{} : ProductPlan::of(l.gate_up),
                            is_sparse ? ProductPlan{} : ProductPlan::of(l.down), KvCacheView::of(k, v), l.window,
                            l.rope_index, pointer(l.q_norm), pointer(l.k_norm), pointer(l.attn_output_norm),
                            pointer(l.mlp_output_norm), this->layer_groups[i], sink_logits(l, num_heads, "DecodeModel"),
                            is_sparse ? l.moe->experts.get() : nullptr,
                            is_sparse ? ProductPlan::of(l.moe->router) : ProductPlan{}, is_sparse ? l.moe->top_k : 0,
                            is_sparse ? l.moe->routing : 0, is_sparse && l.moe->norm_topk_prob,
                            is_sparse ? plan->num_sparse : -1});
    has_output_norms = has_output_norms || l.attn_output_norm || l.mlp_output_norm;
    if (is_sparse) {
      ++plan->num_sparse;
      plan->max_top_k = std::max(plan->max_top_k, l.moe->top_k);
      plan->max_experts = std::max(plan->max_experts, l.moe->experts->num_experts());
      plan->max_moe_intermediate = std::max(plan->max_moe_intermediate, l.moe->experts->intermediate());
      plan->part_kinds.insert(plan->part_kinds.end(), std::begin(kSparsePartKinds), std::end(kSparsePartKinds));
    } else {
      for (int64_t kind = 0; kind < kPartsPerLayer; ++kind) plan->part_kinds.push_back(kind);
    }
    plan->part_begin.push_back(static_cast<int64_t>(plan->part_kinds.size()));
  }
  plan->moe_rows.resize(plan->num_sparse);
  plan->head = ProductPlan::of(this->lm_head);
  plan->final_norm = this->final_norm.data_ptr<float>();
  plan_ = std::move(plan);
}

std::tuple<torch::Tensor, std::optional<std::vector<int64_t>>> DecodeModel::step(
    const std::vector<int64_t>& token_ids, const std::vector<std::vector<std::vector<int64_t>>>& block_tables,
    const std::vector<int64_t>& context_lens, bool with_argmax) const {
  const int64_t step_start = now_ns();
  const int64_t M = static_cast<int64_t>(token_ids.size());
  TORCH_CHECK(M > 0 && static_cast<int64_t>(block_tables.size()) == num_groups &&
              context_lens.size() == token_ids.size(),
              "DecodeModel.step: block tables for each KV-cache group, one context length per token");
  for (const auto& group_tables : block_tables)
    TORCH_CHECK(group_tables.size() == token_ids.size(), "DecodeModel.step: one block table per token and group");
  // The step's attention inputs, from the sequences' own lists: each token sits at its context's
  // last position; padding of shorter tables reads block 0, past the row's length.
  size_t max_blocks = 1;
  for (const auto& group_tables : block_tables)
    for (const auto& table : group_tables) max_blocks = std::max(max_blocks, table.size());
  const int64_t num_slots = std::get<0>(kv_caches.front()).size(0);
  std::vector<int64_t> tables(num_groups * M * max_blocks, 0), positions(M), slots(num_groups * M);
  for (int64_t m = 0; m < M; ++m) {
    const int64_t pos = context_lens[m] - 1;
    positions[m] = pos;
    for (int64_t g = 0; g < num_groups; ++g) {
      const auto& table = block_tables[g][m];
      TORCH_CHECK(pos >= 0 && pos / block_size < static_cast<int64_t>(table.size()),
                  "DecodeModel.step: context length ", context_lens[m], " outside its block table");
      for (const int64_t block : table)
        TORCH_CHECK(block >= 0 && (block + 1) * block_size <= num_slots, "DecodeModel.step: block ", block,
                    " outside the cache");
      std::copy(table.begin(), table.end(), tables.begin() + (g * M + m) * max_blocks);
      slots[g * M + m] = paged_slot(table.data(), block_size, pos);
    }
  }
  const int64_t vocab = std::get<3>(lm_head);
  auto x = gathered_embedding(embedding, token_ids.data(), M, hidden, vocab);  // [M, hidden] float32
  if (embed_scale) scale_embedding(x, *embed_scale);
  std::vector<torch::Tensor> rope_rows;  // per rope, its cos then its sin rows: [M, D] each
  std::vector<const float*> cos, sin;
  for (size_t r = 0; r < rope_cos.size(); ++r) {
    rope_rows.push_back(doubled_rope_rows(rope_cos[r], positions.data(), M));
    rope_rows.push_back(doubled_rope_rows(rope_sin[r], positions.data(), M));
    cos.push_back(rope_rows[2 * r].data_ptr<float>());
    sin.push_back(rope_rows[2 * r + 1].data_ptr<float>());
  }
  auto logits = torch::empty({M, vocab}, x.options());  // [M, vocab] float32
  auto ids = with_argmax ? std::optional<std::vector<int64_t>>(M) : std::nullopt;  // [M]
  const int64_t num_ranks = std::max<int64_t>(1, at::get_num_threads());
  const auto qkv = scratch_floats(M * qkv_width), attn = scratch_floats(M * num_heads * head_dim);
  const auto gate_up = scratch_floats(M * 2 * intermediate);
  const auto act = scratch_floats((M < kFewRows ? num_ranks : 1) * M * intermediate);
  const auto norms = scratch_floats(num_ranks * M * hidden);
  const auto product = scratch_floats(has_output_norms ? M * hidden : 0);
  // Rows of one sequence at consecutive positions (a verification's) form a chain.
  std::vector<int64_t> chains;
  for (int64_t m = 0; m < M; ++m) {
    if (m > 0 && context_lens[m] == context_lens[m - 1] + 1 && block_tables[0][m] == block_tables[0][m - 1])
      ++chains.back();
    else
      chains.push_back(1);
  }
  const DecodeAttentionTasks attention_tasks(context_lens.data(), M, num_kv_heads, num_ranks, chains);
  const Plan& plan = *plan_;
  // The sparse layers' scratch (none without them), sized for the widest.
  const int64_t R = M * plan.max_top_k, moe_I = plan.max_moe_intermediate, moe_H = plan.num_sparse > 0 ? hidden : 0;
  const auto router_logits = scratch_floats(M * plan.max_experts), moe_xs = scratch_floats(R * moe_H);
  const auto moe_h = scratch_floats(R * 2 * moe_I), moe_a = scratch_floats(R * moe_I);
  const auto moe_y = scratch_floats(R * moe_H), moe_sum = scratch_floats(M * moe_H);
  const std::unique_ptr<int8_t[]> moe_xs_q(new int8_t[R * moe_H]), moe_a_q(new int8_t[R * moe_I]);
  const std::unique_ptr<BlockActs[]> moe_xs_blocks(new BlockActs[R * moe_H / 32]),
      moe_a_blocks(new BlockActs[R * moe_I / 32]);
  const int64_t num_parts = plan.part_begin.back() + 2;
  const std::unique_ptr<PartCounter[]> counters(new PartCounter[num_parts]);
  const std::unique_ptr<HomeRange[]> homes(new HomeRange[num_parts * num_ranks]);
  std::vector<int64_t> stamps(num_parts, 0);
  TeamStep s{*this, plan, M, num_ranks, x.data_ptr<float>(), qkv.get(), attn.get(), gate_up.get(), act.get(),
             logits.data_ptr<float>(), ids ? ids->data() : nullptr, norms.get(), product.get(), cos, sin, tables.data(), context_lens.data(), slots.data(),
             static_cast<int64_t>(max_blocks), attention_tasks, counters.get(), homes.get(),
             TeamProgress(num_ranks > usable_cpus() ? kShortSpins : kSpins, stamps.data()), router_logits.get(),
             moe_xs.get(), moe_h.get(), moe_a.get(), moe_y.get(), moe_sum.get(), moe_xs_q.get(), moe_a_q.get(),
             moe_xs_blocks.get(), moe_a_blocks.get()};
  const int64_t team_start = now_ns();
  at::parallel_for(0, num_ranks, 1, [&](int64_t begin, int64_t) { run_member(s, begin); });
  const int64_t num_layer_parts = num_parts - 2, last = ids ? num_parts : num_parts - 1;  // no argmax part run
  int64_t before = team_start;
  for (int64_t part = 0; part < last; ++part) {
    const int64_t kind = part < num_layer_parts ? plan.part_kinds[part] : kPartsPerLayer + part - num_layer_parts;
    part_seconds_[kind] += 1e-9 * static_cast<double>(stamps[part] - before);
    before = stamps[part];
  }
  for (const LayerPlan& layer : plan.layers)  // the step's stats read each sparse layer's count
    if (layer.experts != nullptr) layer.experts->set_last_num_routed(static_cast<int64_t>(plan.moe_rows[layer.sparse].routed.size()));
  part_seconds_[kPartKinds - 1] += 1e-9 * static_cast<double>(team_start - step_start + now_ns() - before);
  ++num_timed_steps_;
  return {logits, std::move(ids)};
}

std::vector<int64_t> team_task_order(int64_t num_tasks, int64_t num_ranks, int64_t rank) {
  TORCH_CHECK(num_ranks > 0 && rank >= 0 && rank < num_ranks && num_tasks >= 0 && num_tasks < (int64_t{1} << 31),
              "team_task_order: 0 <= rank < num_ranks, 0 <= num_tasks < 2^31");
  std::atomic<int64_t> next{0}, done{0};
  const std::unique_ptr<HomeRange[]> homes(new HomeRange[num_ranks]);
  TeamProgress progress(0);
  const TeamShare share{num_ranks, &next, &done, &progress, 0, homes.get(), rank};
  std::vector<int64_t> order;
  share.for_each_task(num_tasks, [&](int64_t task) { order.push_back(task); });
  return order;
}

std::pair<int64_t, std::array<double, DecodeModel::kPartKinds>> DecodeModel::take_part_seconds() const {
  const auto taken = std::make_pair(num_timed_steps_, part_seconds_);
  part_seconds_.fill(0.0);
  num_timed_steps_ = 0;
  return taken;
}

}  // namespace minivllm
