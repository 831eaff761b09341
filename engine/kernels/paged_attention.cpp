// Decode attention straight from the paged KV cache, for the CPU.
//
// The pure-torch path gathers every sequence's context into a dense [B, L, ...] copy per
// layer and then multiplies; at batch 32 that copying costs more than the attention math.
// Here each sequence walks its block table once: scores of every query head (a KV head
// serves `group` of them, GQA), a softmax, then the weighted sum of V. K and V are read
// once, nothing is materialised, and sequences run in parallel across cores.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

// Math in float32 whatever the storage type (float32 or bfloat16).
template <typename scalar_t>
void decode_kernel(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                   const torch::Tensor& block_tables, const torch::Tensor& context_lens, int64_t block_size,
                   double scale, int64_t window, torch::Tensor& out) {
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1), group = num_heads / num_kv_heads;
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode_attention: contiguous cache");
  const int64_t max_blocks = block_tables.size(1);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t slot_stride = num_kv_heads * head_dim;
  const float fscale = static_cast<float>(scale);

  // One task per sequence: each cached token's K (then V) row of all KV heads is contiguous,
  // so it is streamed from memory exactly once.
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf(num_heads * head_dim), acc(num_heads * head_dim), row(slot_stride);
    // Token t's K or V row (all KV heads) of sequence b, as float: fp32 is read in place,
    // other storage types are widened into `row`.
    auto load_row = [&](const scalar_t* cache, int64_t b, int64_t t) -> const float* {
      const int64_t slot = bt[b * max_blocks + t / block_size] * block_size + t % block_size;
      const scalar_t* src = cache + slot * slot_stride;
      if constexpr (std::is_same_v<scalar_t, float>) {
        return src;
      } else {
        for (int64_t i = 0; i < slot_stride; ++i) row[i] = static_cast<float>(src[i]);
        return row.data();
      }
    };
    for (int64_t b = begin; b < end; ++b) {
      // A sliding window (window > 0) keeps the last `window` tokens: [first, lens[b]).
      const int64_t first = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
      const int64_t ctx = lens[b] - first;
      scores.resize(num_heads * ctx);
      for (int64_t i = 0; i < num_heads * head_dim; ++i) qf[i] = static_cast<float>(qp[b * num_heads * head_dim + i]);
      const float* qb = qf.data();
      for (int64_t t = 0; t < ctx; ++t) {
        const float* kt = load_row(kp, b, first + t);
        for (int64_t h = 0; h < num_heads; ++h) {
          const float* qh = qb + h * head_dim;
          const float* kh = kt + (h / group) * head_dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < head_dim; ++d) s += qh[d] * kh[d];
          scores[h * ctx + t] = s * fscale;
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        float* sh = scores.data() + h * ctx;
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
      float* ob = acc.data();
      for (int64_t i = 0; i < num_heads * head_dim; ++i) ob[i] = 0.f;
      for (int64_t t = 0; t < ctx; ++t) {
        const float* vt = load_row(vp, b, first + t);
        for (int64_t h = 0; h < num_heads; ++h) {
          const float p = scores[h * ctx + t];
          const float* vh = vt + (h / group) * head_dim;
          float* oh = ob + h * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) oh[d] += p * vh[d];
        }
      }
      scalar_t* o = op + b * num_heads * head_dim;
      for (int64_t i = 0; i < num_heads * head_dim; ++i) o[i] = static_cast<scalar_t>(ob[i]);
    }
  });
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

// Structured output: logits[rows[i], v] = -inf where bit v of bitmask[i] is 0 (llguidance's
// layout: 32 tokens per int32 word, token v at bit v % 32 of word v / 32). In place, rows in
// parallel: at batch 32 and a 49k vocabulary this is a fraction of the torch unpack-and-mask.
void apply_token_bitmask_(torch::Tensor logits,         // [N, V] float32, contiguous
                          const torch::Tensor& bitmask,  // [R, W] int32
                          const torch::Tensor& rows) {   // [R] int64: the logits row of each mask row
  TORCH_CHECK(logits.scalar_type() == torch::kFloat32 && logits.is_contiguous(), "apply_token_bitmask_: float32 logits");
  TORCH_CHECK(bitmask.scalar_type() == torch::kInt32 && rows.scalar_type() == torch::kInt64, "apply_token_bitmask_: types");
  const int64_t vocab = logits.size(1), words = bitmask.size(1), num_rows = rows.size(0);
  const auto mask = bitmask.contiguous();
  const int32_t* mask_data = mask.data_ptr<int32_t>();
  const int64_t* row_data = rows.data_ptr<int64_t>();
  float* out = logits.data_ptr<float>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = out + row_data[r] * vocab;
      const int32_t* m = mask_data + r * words;
      for (int64_t v = 0; v < vocab; ++v) {
        const int64_t w = v >> 5;
        if (w >= words || !((static_cast<uint32_t>(m[w]) >> (v & 31)) & 1u)) row[v] = neg_inf;
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("apply_token_bitmask_", &apply_token_bitmask_, "Mask logits in place by llguidance token bitmasks (CPU, fp32)");
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU, fp32 or bf16, optional sliding window)");
}
