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

#include <cmath>
#include <vector>

namespace minivllm {
namespace {

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
  packed_gemm(x, M, K, l.w, l.scale, l.bias, l.n, out, l.n, isa, accumulate);
}

// out[m] = x[m] * rsqrt(mean(x[m]^2) + eps) * weight, as transformers' LlamaRMSNorm in float32.
void rms_norm(const float* x, int64_t M, int64_t width, const float* weight, float eps, float* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * width;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < width; ++i) sum += xm[i] * xm[i];
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(width) + eps);
    float* om = out + m * width;
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) om[i] = weight[i] * (xm[i] * inv);
  }
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
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "decode_layer: x must be contiguous float32");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && cos.is_contiguous() &&
              sin.is_contiguous(), "decode_layer: cos and sin must be contiguous float32");
  TORCH_CHECK(input_norm.scalar_type() == torch::kFloat32 && post_norm.scalar_type() == torch::kFloat32,
              "decode_layer: float32 norm weights");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "decode_layer: contiguous cache");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && block_tables.scalar_type() == torch::kInt64 &&
              context_lens.scalar_type() == torch::kInt64 && block_tables.is_contiguous(),
              "decode_layer: int64 slots, block tables and lengths");
  const int64_t M = x.size(0), hidden = x.size(1);
  const int64_t num_kv_heads = k_cache.size(1), head_dim = k_cache.size(2);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const LinearView lqkv = view(qkv), lo = view(o_proj), lgu = view(gate_up), ldown = view(down);
  const int64_t intermediate = lgu.n / 2;
  TORCH_CHECK(lqkv.n == q_size + 2 * kv_size && lo.n == hidden && ldown.n == hidden, "decode_layer: shapes");
  float* xp = x.data_ptr<float>();
  std::vector<float> h(M * hidden), qkv_out(M * lqkv.n), attn_out(M * q_size), gu(M * lgu.n), act(M * intermediate);
  const float* cos_p = cos.data_ptr<float>();
  const float* sin_p = sin.data_ptr<float>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t max_blocks = block_tables.size(1);

  rms_norm(xp, M, hidden, input_norm.data_ptr<float>(), static_cast<float>(eps), h.data());
  gemm(lqkv, h.data(), M, hidden, qkv_out.data(), isa, false);
  for (int64_t m = 0; m < M; ++m) {
    float* row = qkv_out.data() + m * lqkv.n;  // q | k | v
    rope(row, num_heads + num_kv_heads, head_dim, cos_p + m * head_dim, sin_p + m * head_dim);
    if (k_cache.scalar_type() == torch::kFloat32) {
      write_row<float>(k_cache, slots[m], row + q_size, kv_size);
      write_row<float>(v_cache, slots[m], row + q_size + kv_size, kv_size);
    } else {
      TORCH_CHECK(k_cache.scalar_type() == torch::kBFloat16, "decode_layer: float32 or bfloat16 cache");
      write_row<at::BFloat16>(k_cache, slots[m], row + q_size, kv_size);
      write_row<at::BFloat16>(v_cache, slots[m], row + q_size + kv_size, kv_size);
    }
  }
  // One task per (sequence, KV head): at batch 1 both cores still share the attention.
  at::parallel_for(0, M * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t m = task / num_kv_heads;
      attend_decode_row(qkv_out.data() + m * lqkv.n, k_cache, v_cache, tables + m * max_blocks, lens[m], block_size,
                        static_cast<float>(scale), window, num_heads, attn_out.data() + m * q_size, scratch,
                        task % num_kv_heads);
    }
  });
  gemm(lo, attn_out.data(), M, q_size, xp, isa, true);  // x += o_proj(attention)
  rms_norm(xp, M, hidden, post_norm.data_ptr<float>(), static_cast<float>(eps), h.data());
  gemm(lgu, h.data(), M, hidden, gu.data(), isa, false);
  for (int64_t m = 0; m < M; ++m) {
    const float* g = gu.data() + m * lgu.n;
    const float* u = g + intermediate;
    float* a = act.data() + m * intermediate;
    for (int64_t i = 0; i < intermediate; ++i) a[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  }
  gemm(ldown, act.data(), M, intermediate, xp, isa, true);  // x += down(silu(gate) * up)
}

}  // namespace minivllm
