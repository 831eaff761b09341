// One decoder layer for a decode step of a few sequences, in one call (the CPU counterpart of
// a CUDA graph): RMSNorm, the fused QKV projection, RoPE, the KV-cache write, paged attention,
// the output projection with its residual, RMSNorm, the gated MLP with its residual.
//
// At batch 1 the torch path spends a third of the step dispatching about 150 small ops per
// token (norms, rotations, adds, casts, index copies); here they are loops over a few
// thousand floats between the packed matrix products, which read the weights once.
// Activations and the residual stream stay float32; the KV cache keeps its own dtype.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>

#include "simd_exp.h"
#endif

namespace minivllm {
namespace {

// a[i] = silu(g[i]) * u[i] = g[i] / (1 + e^-g[i]) * u[i]: 16 lanes at a time with AVX-512 (a
// batch-32 step has 49k of them per layer; one libm call each cost more than the layer's
// matrix products), a scalar loop elsewhere and for the tail.
#if defined(__x86_64__)
__attribute__((target("avx512f,fma"))) int64_t silu_mul_avx512(const float* g, const float* u, float* a, int64_t n) {
  int64_t i = 0;
  const __m512 one = _mm512_set1_ps(1.f);
  for (; i + 16 <= n; i += 16) {
    const __m512 gv = _mm512_loadu_ps(g + i);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    _mm512_storeu_ps(a + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + i)));
  }
  return i;
}
#endif

void silu_mul(const float* g, const float* u, float* a, int64_t n, int64_t isa) {
  int64_t i = 0;
#if defined(__x86_64__)
  if (isa >= kIsaAvx512) i = silu_mul_avx512(g, u, a, n);
#endif
  for (; i < n; ++i) a[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

// Rows per task of the row-wise parts (norms, RoPE, SiLU): a decode step's few rows stay on
// the calling thread; a prefill chunk's hundreds are shared, not left to one core while the
// other spins at the next product's barrier.
constexpr int64_t kRowGrain = 16;

// A scratch array every element of which is written before it is read: no zeroing (a memset of
// a prefill chunk's MLP activations cost 6 % of its step).
std::unique_ptr<float[]> scratch_floats(int64_t n) { return std::unique_ptr<float[]>(new float[n]); }

struct LinearView {
  const torch::Tensor& w;
  const float* scale;
  const float* bias;
  int64_t n;
};

LinearView view(const PackedLinear& linear) {
  const auto& [w, scale, bias, n] = linear;
  TORCH_CHECK(!scale || scale->scalar_type() == torch::kFloat32, "decode_layer: float32 scales");
  TORCH_CHECK(!bias || bias->scalar_type() == torch::kFloat32, "decode_layer: float32 bias");
  return {w, scale ? scale->data_ptr<float>() : nullptr, bias ? bias->data_ptr<float>() : nullptr, n};
}

void gemm(const LinearView& l, const float* x, int64_t M, int64_t K, float* out, int64_t isa, bool accumulate) {
  packed_gemm(x, M, K, K, l.w, l.scale, l.bias, l.n, out, l.n, isa, accumulate);
}

// out[m] = x[m] * rsqrt(mean(x[m]^2) + eps) * weight, as transformers' LlamaRMSNorm in float32.
void rms_norm(const float* x, int64_t M, int64_t width, const float* weight, float eps, float* out) {
  at::parallel_for(0, M, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* xm = x + m * width;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < width; ++i) sum += xm[i] * xm[i];
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(width) + eps);
      float* om = out + m * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) om[i] = weight[i] * (xm[i] * inv);
    }
  });
}

// Rotate-half RoPE of `num_heads` heads of one token in place: cos, sin [D].
void rope(float* heads, int64_t num_heads, int64_t head_dim, const float* cos, const float* sin) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < num_heads; ++h) {
    float* x = heads + h * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[i], b = x[i + half];
      x[i] = a * cos[i] - b * sin[i];
      x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
  }
}

template <typename cache_t>
void write_row(torch::Tensor& cache, int64_t slot, const float* src, int64_t width) {
  cache_t* dst = cache.data_ptr<cache_t>() + slot * width;
  for (int64_t i = 0; i < width; ++i) dst[i] = static_cast<cache_t>(src[i]);
}

// The shapes the layer's parts share.
struct LayerShapes {
  int64_t M, hidden, num_heads, num_kv_heads, head_dim, q_size, kv_size;
};

LayerShapes shapes_of(const torch::Tensor& x, const torch::Tensor& k_cache, int64_t num_heads) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2,
              "fused layer: x must be contiguous float32 [M, hidden]");
  TORCH_CHECK(k_cache.is_contiguous(), "fused layer: contiguous cache");
  const int64_t num_kv_heads = k_cache.size(1), head_dim = k_cache.size(2);
  return {x.size(0), x.size(1), num_heads, num_kv_heads, head_dim, num_heads * head_dim, num_kv_heads * head_dim};
}

// Before attention: RMSNorm, QKV projection, RoPE of q and k, the new K/V written at their slots.
// qkv_out: [M, q_size + 2 * kv_size] float32 (q | k | v per row).
void attention_inputs(const LayerShapes& s, const float* xp, const torch::Tensor& cos, const torch::Tensor& sin,
                      const torch::Tensor& input_norm, const LinearView& lqkv, torch::Tensor& k_cache,
                      torch::Tensor& v_cache, const torch::Tensor& slot_mapping, double eps, int64_t isa,
                      float* qkv_out) {
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && cos.is_contiguous() &&
              sin.is_contiguous() && cos.size(0) == s.M, "fused layer: cos and sin must be contiguous float32 [M, D]");
  TORCH_CHECK(input_norm.scalar_type() == torch::kFloat32, "fused layer: float32 norm weights");
  TORCH_CHECK(v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type(), "fused layer: cache layout");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.size(0) == s.M,
              "fused layer: int64 slot_mapping [M]");
  TORCH_CHECK(lqkv.n == s.q_size + 2 * s.kv_size, "fused layer: QKV projection width");
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat32 || k_cache.scalar_type() == torch::kBFloat16,
              "fused layer: float32 or bfloat16 cache");
  const auto h = scratch_floats(s.M * s.hidden);
  rms_norm(xp, s.M, s.hidden, input_norm.data_ptr<float>(), static_cast<float>(eps), h.get());
  gemm(lqkv, h.get(), s.M, s.hidden, qkv_out, isa, false);
  const float* cos_p = cos.data_ptr<float>();
  const float* sin_p = sin.data_ptr<float>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const bool fp32_cache = k_cache.scalar_type() == torch::kFloat32;
  at::parallel_for(0, s.M, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      float* row = qkv_out + m * lqkv.n;  // q | k | v
      rope(row, s.num_heads + s.num_kv_heads, s.head_dim, cos_p + m * s.head_dim, sin_p + m * s.head_dim);
      if (fp32_cache) {
        write_row<float>(k_cache, slots[m], row + s.q_size, s.kv_size);
        write_row<float>(v_cache, slots[m], row + s.q_size + s.kv_size, s.kv_size);
      } else {
        write_row<at::BFloat16>(k_cache, slots[m], row + s.q_size, s.kv_size);
        write_row<at::BFloat16>(v_cache, slots[m], row + s.q_size + s.kv_size, s.kv_size);
      }
    }
  });
}

// After attention: x += o_proj(attn_out); x += down(silu(gate) * up) of RMSNorm(x).
// attn_out: [M, q_size]; x: [M, hidden].
void attention_outputs(int64_t M, int64_t hidden, int64_t q_size, float* xp, const float* attn_out,
                       const torch::Tensor& post_norm, const LinearView& lo, const LinearView& lgu,
                       const LinearView& ldown, double eps, int64_t isa) {
  TORCH_CHECK(post_norm.scalar_type() == torch::kFloat32, "fused layer: float32 norm weights");
  TORCH_CHECK(lo.n == hidden && ldown.n == hidden, "fused layer: output projection widths");
  const int64_t intermediate = lgu.n / 2;
  const auto h = scratch_floats(M * hidden), gu = scratch_floats(M * lgu.n), act = scratch_floats(M * intermediate);
  gemm(lo, attn_out, M, q_size, xp, isa, true);
  rms_norm(xp, M, hidden, post_norm.data_ptr<float>(), static_cast<float>(eps), h.get());
  gemm(lgu, h.get(), M, hidden, gu.get(), isa, false);
  at::parallel_for(0, M, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* g = gu.get() + m * lgu.n;
      silu_mul(g, g + intermediate, act.get() + m * intermediate, intermediate, isa);
    }
  });
  gemm(ldown, act.get(), M, intermediate, xp, isa, true);
}

}  // namespace

void decode_layer(torch::Tensor x,                    // [M, hidden] float32, updated in place
                  const torch::Tensor& cos,           // [M, D] float32
                  const torch::Tensor& sin,           // [M, D] float32
                  const torch::Tensor& input_norm,    // [hidden] float32
                  const torch::Tensor& post_norm,     // [hidden] float32
                  const PackedLinear& qkv, const PackedLinear& o_proj, const PackedLinear& gate_up,
                  const PackedLinear& down,
                  torch::Tensor k_cache,              // [slots, KVH, D]
                  torch::Tensor v_cache,              // [slots, KVH, D]
                  const torch::Tensor& slot_mapping,  // [M] int64
                  const torch::Tensor& block_tables,  // [M, max_blocks] int64
                  const torch::Tensor& context_lens,  // [M] int64
                  int64_t num_heads, int64_t block_size, double eps, double scale, int64_t window, int64_t isa) {
  const LinearView lqkv = view(qkv);
  const LayerShapes s = shapes_of(x, k_cache, num_heads);
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && context_lens.scalar_type() == torch::kInt64 &&
              block_tables.is_contiguous(), "decode_layer: int64 block tables and lengths");
  float* xp = x.data_ptr<float>();
  const auto qkv_out = scratch_floats(s.M * lqkv.n), attn_out = scratch_floats(s.M * s.q_size);
  attention_inputs(s, xp, cos, sin, input_norm, lqkv, k_cache, v_cache, slot_mapping, eps, isa, qkv_out.get());
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t max_blocks = block_tables.size(1);
  // One task per sequence, whose K and V rows (all KV heads) then stream once; at a batch too
  // small to keep every core busy, one per (sequence, KV head), each reading a third of a row
  // (with SmolLM2's 3 KV heads), so the cores share even a single sequence.
  const int64_t num_threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t heads_per_task = s.M >= 4 * num_threads ? s.num_kv_heads : 1;
  const int64_t tasks_per_row = s.num_kv_heads / heads_per_task, num_tasks = s.M * tasks_per_row;
  // Sequences' contexts differ in length: the longest first, each thread taking the next from a
  // shared counter, so the threads finish together (an even split of rows left one thread
  // spinning for a fifth of a batch-32 step).
  std::vector<int64_t> rows_by_len(s.M);
  std::iota(rows_by_len.begin(), rows_by_len.end(), 0);
  std::stable_sort(rows_by_len.begin(), rows_by_len.end(), [&](int64_t a, int64_t b) { return lens[a] > lens[b]; });
  std::atomic<int64_t> next_task{0};
  at::parallel_for(0, std::min(num_threads, num_tasks), 1, [&](int64_t, int64_t) {
    std::vector<float> scratch;
    for (int64_t task = next_task++; task < num_tasks; task = next_task++) {
      const int64_t m = rows_by_len[task / tasks_per_row], kv_begin = (task % tasks_per_row) * heads_per_task;
      attend_decode_row(qkv_out.get() + m * lqkv.n, k_cache, v_cache, tables + m * max_blocks, lens[m], block_size,
                        static_cast<float>(scale), window, num_heads, attn_out.get() + m * s.q_size, scratch,
                        kv_begin, kv_begin + heads_per_task, isa);
    }
  });
  attention_outputs(s.M, s.hidden, s.q_size, xp, attn_out.get(), post_norm, view(o_proj), view(gate_up), view(down),
                    eps, isa);
}

namespace {

// Every layer of the model on x, in place: decode_layer per layer.
void decode_layers(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                   const std::vector<std::shared_ptr<DecodeLayerWeights>>& layers,
                   const std::vector<std::tuple<torch::Tensor, torch::Tensor>>& kv_caches,
                   const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                   const torch::Tensor& context_lens, int64_t num_heads, int64_t block_size, double eps, double scale,
                   int64_t isa) {
  for (size_t i = 0; i < layers.size(); ++i) {
    const DecodeLayerWeights& l = *layers[i];
    const auto& [k_cache, v_cache] = kv_caches[i];
    decode_layer(x, cos, sin, l.input_norm, l.post_norm, l.qkv, l.o_proj, l.gate_up, l.down, k_cache, v_cache,
                 slot_mapping, block_tables, context_lens, num_heads, block_size, eps, scale, l.window, isa);
  }
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
// to it (or the first NaN). 6.9 us a [1, 49152] row (numpy: 6.8; this file's first version, two
// `#pragma omp simd` passes the compiler left scalar: 52-78); 163 us at [64, 49152] on two
// threads (numpy: 337).
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

}  // namespace

DecodeModel::DecodeModel(torch::Tensor embedding, torch::Tensor rope_cos, torch::Tensor rope_sin,
                         std::vector<std::shared_ptr<DecodeLayerWeights>> layers,
                         std::vector<std::tuple<torch::Tensor, torch::Tensor>> kv_caches, torch::Tensor final_norm,
                         PackedLinear lm_head, int64_t num_heads, int64_t block_size, double eps, double scale,
                         int64_t isa)
    : embedding(std::move(embedding)), rope_cos(std::move(rope_cos)), rope_sin(std::move(rope_sin)),
      layers(std::move(layers)), kv_caches(std::move(kv_caches)), final_norm(std::move(final_norm)),
      lm_head(std::move(lm_head)), num_heads(num_heads), block_size(block_size), eps(eps), scale(scale), isa(isa) {
  TORCH_CHECK(this->kv_caches.size() == this->layers.size(), "DecodeModel: one (K, V) cache pair per layer");
  TORCH_CHECK(this->rope_cos.scalar_type() == torch::kFloat32 && this->rope_sin.scalar_type() == torch::kFloat32 &&
              this->rope_cos.sizes() == this->rope_sin.sizes(), "DecodeModel: float32 RoPE tables of one shape");
  TORCH_CHECK(this->final_norm.scalar_type() == torch::kFloat && this->final_norm.dim() == 1 &&
              this->embedding.dim() == 2 && this->final_norm.numel() == this->embedding.size(1),
              "DecodeModel: final_norm must be [hidden] float32");
}

std::tuple<torch::Tensor, std::optional<torch::Tensor>> DecodeModel::step(
    const std::vector<int64_t>& token_ids, const std::vector<std::vector<int64_t>>& block_tables,
    const std::vector<int64_t>& context_lens, bool with_argmax) const {
  const int64_t M = static_cast<int64_t>(token_ids.size());
  TORCH_CHECK(M > 0 && block_tables.size() == token_ids.size() && context_lens.size() == token_ids.size(),
              "DecodeModel.step: one block table and one context length per token");
  // The step's attention inputs, from the sequences' own lists: each token sits at its context's
  // last position; padding of shorter tables reads block 0, past the row's length.
  size_t max_blocks = 1;
  for (const auto& table : block_tables) max_blocks = std::max(max_blocks, table.size());
  const auto int64 = torch::TensorOptions().dtype(torch::kInt64);
  auto tables = torch::zeros({M, static_cast<int64_t>(max_blocks)}, int64);
  auto lens = torch::empty({M}, int64), positions = torch::empty({M}, int64), slots = torch::empty({M}, int64);
  int64_t *tp = tables.data_ptr<int64_t>(), *len_p = lens.data_ptr<int64_t>(), *pp = positions.data_ptr<int64_t>(),
          *sp = slots.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    const auto& table = block_tables[m];
    const int64_t pos = context_lens[m] - 1;
    TORCH_CHECK(pos >= 0 && pos / block_size < static_cast<int64_t>(table.size()),
                "DecodeModel.step: context length ", context_lens[m], " outside its block table");
    std::copy(table.begin(), table.end(), tp + m * max_blocks);
    len_p[m] = context_lens[m];
    pp[m] = pos;
    sp[m] = table[pos / block_size] * block_size + pos % block_size;
  }
  auto x = gathered_rows(embedding, token_ids.data(), M, "embedding");  // [M, hidden] float32
  const auto cos = gathered_rows(rope_cos, pp, M, "RoPE table"), sin = gathered_rows(rope_sin, pp, M, "RoPE table");
  decode_layers(x, cos, sin, layers, kv_caches, slots, tables, lens, num_heads, block_size, eps, scale, isa);
  float* xp = x.data_ptr<float>();
  // In place: each row's sum of squares is taken before the row is written.
  rms_norm(xp, x.size(0), x.size(1), final_norm.data_ptr<float>(), static_cast<float>(eps), xp);
  const LinearView head = view(lm_head);
  auto logits = torch::empty({x.size(0), head.n}, x.options());  // [M, vocab] float32
  gemm(head, xp, x.size(0), x.size(1), logits.data_ptr<float>(), isa, false);
  if (!with_argmax) return {logits, std::nullopt};
  auto ids = torch::empty({x.size(0)}, x.options().dtype(torch::kInt64));  // [M]
  const float* lp = logits.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  at::parallel_for(0, x.size(0), 4, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) ip[m] = first_argmax(lp + m * head.n, head.n, isa);
  });
  return {logits, ids};
}

torch::Tensor layer_attention_inputs(const torch::Tensor& x,             // [M, hidden] float32
                                     const torch::Tensor& cos,           // [M, D] float32
                                     const torch::Tensor& sin,           // [M, D] float32
                                     const torch::Tensor& input_norm,    // [hidden] float32
                                     const PackedLinear& qkv,
                                     torch::Tensor k_cache,              // [slots, KVH, D]
                                     torch::Tensor v_cache,              // [slots, KVH, D]
                                     const torch::Tensor& slot_mapping,  // [M] int64
                                     int64_t num_heads, double eps, int64_t isa) {
  const LinearView lqkv = view(qkv);
  const LayerShapes s = shapes_of(x, k_cache, num_heads);
  auto out = torch::empty({s.M, lqkv.n}, x.options());  // [M, q | k | v]
  attention_inputs(s, x.data_ptr<float>(), cos, sin, input_norm, lqkv, k_cache, v_cache, slot_mapping, eps, isa,
                   out.data_ptr<float>());
  return out;
}

void layer_attention_outputs(torch::Tensor x,                  // [M, hidden] float32, updated in place
                             const torch::Tensor& attn_out,    // [M, H * D] float32
                             const torch::Tensor& post_norm,   // [hidden] float32
                             const PackedLinear& o_proj, const PackedLinear& gate_up, const PackedLinear& down,
                             double eps, int64_t isa) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2,
              "fused layer: x must be contiguous float32 [M, hidden]");
  TORCH_CHECK(attn_out.scalar_type() == torch::kFloat32 && attn_out.is_contiguous() && attn_out.dim() == 2 &&
              attn_out.size(0) == x.size(0), "fused layer: attn_out must be contiguous float32 [M, H * D]");
  attention_outputs(x.size(0), x.size(1), attn_out.size(1), x.data_ptr<float>(), attn_out.data_ptr<float>(), post_norm,
                    view(o_proj), view(gate_up), view(down), eps, isa);
}

}  // namespace minivllm
