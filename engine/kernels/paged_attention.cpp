// Decode attention straight from the paged KV cache, for the CPU.
//
// The pure-torch path gathers every sequence's context into a dense [B, L, ...] copy per
// layer and then multiplies; at batch 32 that copying costs more than the attention math.
// Here each sequence walks its block table once: scores of every query head (a KV head
// serves `group` of them, GQA), a softmax, then the weighted sum of V. K and V are read
// once, nothing is materialised, and sequences run in parallel across cores.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace minivllm {
namespace {

// One sequence, math in float32 whatever the storage type (float32 or bfloat16): q [H, D] ->
// out [H, D], for the query heads of KV heads [kv_begin, kv_end) (all of them by default).
// scratch holds the scores and one widened cache row.
template <typename cache_t>
void attend_one(const float* qb, const cache_t* kp, const cache_t* vp, const int64_t* table, int64_t len,
                int64_t block_size, float scale, int64_t window, int64_t num_heads, int64_t num_kv_heads,
                int64_t head_dim, float* ob, std::vector<float>& scratch, int64_t kv_begin = 0,
                int64_t kv_end = -1) {
  const int64_t group = num_heads / num_kv_heads, slot_stride = num_kv_heads * head_dim;
  const int64_t h_begin = kv_begin * group, h_end = (kv_end < 0 ? num_kv_heads : kv_end) * group;
  // A sliding window (window > 0) keeps the last `window` tokens: [first, len).
  const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
  const int64_t ctx = len - first;
  scratch.resize(num_heads * ctx + slot_stride);
  float* scores = scratch.data();
  float* row = scores + num_heads * ctx;
  // Token t's K or V row (all KV heads), as float: fp32 is read in place, other storage types
  // are widened into `row`.
  auto load_row = [&](const cache_t* cache, int64_t t) -> const float* {
    const int64_t slot = table[t / block_size] * block_size + t % block_size;
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
    float sum = 0.f;
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
                   double scale, int64_t window, torch::Tensor& out) {
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
                 block_size, static_cast<float>(scale), window, num_heads, num_kv_heads, head_dim, acc.data(), scratch);
      for (int64_t i = 0; i < width; ++i) op[b * width + i] = static_cast<scalar_t>(acc[i]);
    }
  });
}

}  // namespace

void attend_decode_row(const float* q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                       const int64_t* block_table, int64_t context_len, int64_t block_size, float scale,
                       int64_t window, int64_t num_heads, float* out, std::vector<float>& scratch,
                       int64_t kv_begin, int64_t kv_end) {
  const int64_t num_kv_heads = k_cache.size(1), head_dim = k_cache.size(2);
  if (k_cache.scalar_type() == torch::kFloat32) {
    attend_one(q, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), block_table, context_len, block_size, scale,
               window, num_heads, num_kv_heads, head_dim, out, scratch, kv_begin, kv_end);
  } else {
    TORCH_CHECK(k_cache.scalar_type() == torch::kBFloat16, "attention: float32 or bfloat16 cache only");
    attend_one(q, k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), block_table, context_len,
               block_size, scale, window, num_heads, num_kv_heads, head_dim, out, scratch, kv_begin, kv_end);
  }
}

torch::Tensor paged_decode_attention(torch::Tensor q,             // [B, H, D]
                                     torch::Tensor k_cache,       // [slots, KVH, D]
                                     torch::Tensor v_cache,       // [slots, KVH, D]
                                     torch::Tensor block_tables,  // [B, max_blocks] int64
                                     torch::Tensor context_lens,  // [B] int64
                                     int64_t block_size, double scale,
                                     int64_t window) {             // 0: none, else the last `window` tokens
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_decode_attention: q and cache dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && context_lens.scalar_type() == torch::kInt64,
              "paged_decode_attention: int64 block tables and lengths");
  q = q.contiguous();
  auto out = torch::empty_like(q);
  if (q.scalar_type() == torch::kFloat32) {
    decode_kernel<float>(q, k_cache, v_cache, block_tables, context_lens, block_size, scale, window, out);
  } else if (q.scalar_type() == torch::kBFloat16) {
    decode_kernel<at::BFloat16>(q, k_cache, v_cache, block_tables, context_lens, block_size, scale, window, out);
  } else {
    TORCH_CHECK(false, "paged_decode_attention: float32 or bfloat16 only");
  }
  return out;
}

}  // namespace minivllm
