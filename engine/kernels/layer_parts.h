// The row-wise parts of a decoder layer and the view of a packed projection, shared by the
// per-layer kernel (decode_layer.cpp) and the whole-model decode step (decode_model.cpp).
#pragma once

#include "cpu_kernels.h"

#include <memory>

namespace minivllm {

// Rows per task of the row-wise parts (norms, RoPE, SiLU): a decode step's few rows stay on
// the calling thread; a prefill chunk's hundreds are shared, not left to one core while the
// other spins at the next product's barrier.
constexpr int64_t kRowGrain = 16;

// a[i] = silu(g[i]) * u[i], i < n.
void silu_mul(const float* g, const float* u, float* a, int64_t n, int64_t isa);
// out[m] = x[m] * rsqrt(mean(x[m]^2) + eps) * weight, rows of `width`, as transformers'
// LlamaRMSNorm in float32 (out may be x). Rows run in parallel outside a parallel region.
void rms_norm(const float* x, int64_t M, int64_t width, const float* weight, float eps, float* out);
// Rotate-half RoPE of `num_heads` heads of one token in place: cos, sin [D].
void rope(float* heads, int64_t num_heads, int64_t head_dim, const float* cos, const float* sin);

// A scratch array every element of which is written before it is read: no zeroing (a memset of
// a prefill chunk's MLP activations cost 6 % of its step).
inline std::unique_ptr<float[]> scratch_floats(int64_t n) { return std::unique_ptr<float[]>(new float[n]); }

// A packed projection's parts as the kernels take them.
struct LinearView {
  const torch::Tensor& w;
  const float* scale;
  const float* bias;
  int64_t n;
};

inline LinearView view(const PackedLinear& linear) {
  const auto& [w, scale, bias, n] = linear;
  TORCH_CHECK(!scale || scale->scalar_type() == torch::kFloat32, "decode_layer: float32 scales");
  TORCH_CHECK(!bias || bias->scalar_type() == torch::kFloat32, "decode_layer: float32 bias");
  return {w, scale ? scale->data_ptr<float>() : nullptr, bias ? bias->data_ptr<float>() : nullptr, n};
}

}  // namespace minivllm
