// The elementwise parts of an encoder layer (BERT's post-LayerNorm blocks), fused into the packed
// products they follow, so that a step's hundreds of rows are not walked again from memory for
// each: the up projection's bias + GELU applied to each output tile while it is in L1
// (packed_linear_gelu), and the output projections' bias + residual add (accumulated into the
// residual stream) followed by the block's LayerNorm over each row in place
// (packed_linear_add_norm_). Activations and sums stay float32.
#include "cpu_kernels.h"
#include "layer_parts.h"

#include <ATen/Parallel.h>

#include <cmath>

namespace minivllm {
namespace {

inline float gelu_scalar(float x, int64_t act) {
  if (act == kOutGeluTanh) return gelu_tanh(x);
  return 0.5f * x * (1.f + std::erf(x * static_cast<float>(M_SQRT1_2)));
}

#if defined(__x86_64__)
__attribute__((target("avx512f,fma"))) int64_t activate_avx512(float* y, int64_t n, int64_t act) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(y + i);
    _mm512_storeu_ps(y + i, act == kOutGeluTanh ? gelu_tanh512(x) : gelu_erf512(x));
  }
  return i;
}
#endif

// One row in place: y = (y - mean) / sqrt(var + eps) * weight + bias, as torch's LayerNorm (biased
// variance), the mean and variance in two passes over the row (in L1).
inline void layer_norm_row(float* y, int64_t width, const float* weight, const float* bias, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < width; ++i) sum += y[i];
  const float mean = sum / static_cast<float>(width);
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < width; ++i) squares += (y[i] - mean) * (y[i] - mean);
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(width) + eps);
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) y[i] = (y[i] - mean) * inv * weight[i] + bias[i];
}

#if defined(__x86_64__)
// layer_norm_row for width a multiple of 16, in AVX-512 with four independent sums a pass (one
// sum a pass was a chain of dependent adds, 24 at bge-small's 384: the norm then took 4.6 % of
// an encoder step). The same two-pass mean and variance; the sums' order differs (float rounding).
__attribute__((target("avx512f,fma"))) void layer_norm_row_avx512(float* y, int64_t width, const float* weight,
                                                                  const float* bias, float eps) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t i = 0; i < width; i += 16) acc[(i / 16) % 4] = _mm512_add_ps(acc[(i / 16) % 4], _mm512_loadu_ps(y + i));
  const float mean =
      _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]))) /
      static_cast<float>(width);
  const __m512 mv = _mm512_set1_ps(mean);
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t i = 0; i < width; i += 16) {
    const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(y + i), mv);
    acc[(i / 16) % 4] = _mm512_fmadd_ps(d, d, acc[(i / 16) % 4]);
  }
  const float squares = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
  const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(squares / static_cast<float>(width) + eps));
  for (int64_t i = 0; i < width; i += 16) {
    const __m512 d = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(y + i), mv), inv);
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(d, _mm512_loadu_ps(weight + i), _mm512_loadu_ps(bias + i)));
  }
}
#endif

const float* bias_of(const std::optional<torch::Tensor>& bias, int64_t n) {
  if (!bias) return nullptr;
  TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == n,
              "encoder parts: bias must be float32 [n], contiguous");
  return bias->data_ptr<float>();
}

}  // namespace

void activate(float* y, int64_t n, int64_t act, int64_t isa) {
  int64_t i = 0;
#if defined(__x86_64__)
  if (isa >= kIsaAvx512) i = activate_avx512(y, n, act);
#endif
  for (; i < n; ++i) y[i] = gelu_scalar(y[i], act);
}

// x: [M, K] -> GELU(x W^T + bias) [M, n] float32 (is_tanh: the tanh approximation); bf16_out:
// [M, n] bfloat16, the float32 values rounded to nearest-even (the down product's left operand as
// it rounds it), from the tiles' epilogue where the panels run on AMX and n is a multiple of 32.
torch::Tensor packed_linear_gelu(const torch::Tensor& x, const torch::Tensor& w, const std::optional<torch::Tensor>& bias,
                                 int64_t n, int64_t isa, bool is_tanh, bool bf16_out) {
  TORCH_CHECK(x.dim() == 2, "packed_linear_gelu: x must be [M, K]");
  const auto xf = x.to(torch::kFloat32).contiguous();
  const int64_t act = is_tanh ? kOutGeluTanh : kOutGelu;
  if (bf16_out) {
    auto out = scratch_tensor({x.size(0), n}, xf.options().dtype(torch::kBFloat16));
    if (packed_gemm_bf16_out(xf.data_ptr<float>(), x.size(0), x.size(1), w, bias_of(bias, n), n, act,
                              reinterpret_cast<uint16_t*>(out.data_ptr()), isa))
      return out;
  }
  auto out = scratch_tensor({x.size(0), n}, xf.options());
  packed_gemm_activated(xf.data_ptr<float>(), x.size(0), x.size(1), x.size(1), w, bias_of(bias, n), n,
                        out.data_ptr<float>(), n, isa, false, act);
  return bf16_out ? out.to(torch::kBFloat16) : out;
}

// residual [M, n] float32 = LayerNorm(residual + x W^T + bias) in place: a post-LayerNorm block's
// output projection, residual add and norm in one call.
void packed_linear_add_norm_(const torch::Tensor& x, const torch::Tensor& w, const std::optional<torch::Tensor>& bias,
                             int64_t n, int64_t isa, torch::Tensor residual, const torch::Tensor& norm_weight,
                             const torch::Tensor& norm_bias, double eps) {
  TORCH_CHECK(x.dim() == 2, "packed_linear_add_norm_: x must be [M, K]");
  const int64_t M = x.size(0);
  TORCH_CHECK(residual.dim() == 2 && residual.size(0) == M && residual.size(1) == n &&
              residual.scalar_type() == torch::kFloat32 && residual.is_contiguous(),
              "packed_linear_add_norm_: residual must be float32 [M, n], contiguous");
  for (const auto* t : {&norm_weight, &norm_bias})
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->numel() == n,
                "packed_linear_add_norm_: the norm's weight and bias must be float32 [n], contiguous");
  float* out = residual.data_ptr<float>();
  // bfloat16 x (packed_linear_gelu's bf16_out) goes to the tiles as it is; elsewhere it is widened
  const bool is_bf16_rows = x.scalar_type() == torch::kBFloat16 && x.is_contiguous() &&
                            packed_gemm_bf16_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, x.size(1), w,
                                                  bias_of(bias, n), n, out, n, true, isa);
  if (!is_bf16_rows) {
    const auto xf = x.to(torch::kFloat32).contiguous();
    packed_gemm_activated(xf.data_ptr<float>(), M, x.size(1), x.size(1), w, bias_of(bias, n), n, out, n, isa, true,
                          kOutNone);
  }
  const float* weight = norm_weight.data_ptr<float>();
  const float* shift = norm_bias.data_ptr<float>();
  const auto e = static_cast<float>(eps);
  at::parallel_for(0, M, kRowGrain, [&](int64_t begin, int64_t end) {
#if defined(__x86_64__)
    if (isa >= kIsaAvx512 && n % 16 == 0) {
      for (int64_t m = begin; m < end; ++m) layer_norm_row_avx512(out + m * n, n, weight, shift, e);
      return;
    }
#endif
    for (int64_t m = begin; m < end; ++m) layer_norm_row(out + m * n, n, weight, shift, e);
  });
}

}  // namespace minivllm
