// One decoder layer for a decode step of a few sequences, in one call (the CPU counterpart of
// a CUDA graph): RMSNorm, the fused QKV projection, the per-head q/k norms (Qwen3, Gemma 3),
// RoPE, the KV-cache write, paged attention, the output projection with its residual (its output
// normed first in Gemma), RMSNorm, the gated MLP (SiLU or tanh GELU) with its residual (normed
// first in Gemma).
//
// At batch 1 the torch path spends much of the step dispatching about 150 small ops per
// token (norms, rotations, adds, casts, index copies); here they are loops over a few
// thousand floats between the packed matrix products, which read the weights once.
// Activations and the residual stream stay float32; the KV cache keeps its own dtype.
#include "cpu_kernels.h"
#include "layer_parts.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <numeric>
#include <vector>

namespace minivllm {
namespace {

// a[i] = silu(g[i]) * u[i] = g[i] / (1 + e^-g[i]) * u[i]: 16 lanes at a time with AVX-512 (a
// batch-32 step has 49k of them per layer; one libm call each cost more than the layer's
// matrix products), a scalar loop elsewhere and for the tail.
#if defined(__x86_64__)
__attribute__((target("avx512f,fma"))) int64_t silu_mul_avx512(const float* g, const float* u, float* a, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(a + i, silu_mul512(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i)));
  return i;
}

// a[i] = gelu_tanh(g[i]) * u[i], 16 lanes at a time, as silu_mul_avx512.
__attribute__((target("avx512f,fma"))) int64_t gelu_tanh_mul_avx512(const float* g, const float* u, float* a,
                                                                     int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(a + i, _mm512_mul_ps(gelu_tanh512(_mm512_loadu_ps(g + i)), _mm512_loadu_ps(u + i)));
  return i;
}
#endif

}  // namespace

void silu_mul(const float* g, const float* u, float* a, int64_t n, int64_t isa) {
  int64_t i = 0;
#if defined(__x86_64__)
  if (isa >= kIsaAvx512) i = silu_mul_avx512(g, u, a, n);
#endif
  for (; i < n; ++i) a[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

void gelu_tanh_mul(const float* g, const float* u, float* a, int64_t n, int64_t isa) {
  int64_t i = 0;
#if defined(__x86_64__)
  if (isa >= kIsaAvx512) i = gelu_tanh_mul_avx512(g, u, a, n);
#endif
  for (; i < n; ++i) a[i] = gelu_tanh(g[i]) * u[i];
}

// out[m] = x[m] * rsqrt(mean(x[m]^2) + eps) * weight, as transformers' LlamaRMSNorm in float32.
void rms_norm(const float* x, int64_t M, int64_t width, const float* weight, float eps, float* out) {
  at::parallel_for(0, M, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) rms_norm_row(x + m * width, width, weight, eps, out + m * width);
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

namespace {

void gemm(const LinearView& l, const float* x, int64_t M, int64_t K, float* out, int64_t isa, bool accumulate) {
  packed_gemm(x, M, K, K, l.w, l.scale, l.bias, l.n, out, l.n, isa, accumulate);
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

// A layer's optional norm weight of `width` floats, checked; nullptr when the layer has none.
const float* optional_norm(const std::optional<torch::Tensor>& norm, int64_t width, const char* what) {
  if (!norm) return nullptr;
  TORCH_CHECK(norm->scalar_type() == torch::kFloat32 && norm->is_contiguous() && norm->numel() == width,
              "fused layer: ", what, " must be contiguous float32 of ", width, " values");
  return norm->data_ptr<float>();
}

// Before attention: RMSNorm, QKV projection, the per-head q and k norms (where the layer has
// them), RoPE of q and k, the new K/V written at their slots.
// qkv_out: [M, q_size + 2 * kv_size] float32 (q | k | v per row).
void attention_inputs(const LayerShapes& s, const float* xp, const torch::Tensor& cos, const torch::Tensor& sin,
                      const DecodeLayerWeights& w, const LinearView& lqkv, torch::Tensor& k_cache,
                      torch::Tensor& v_cache, const torch::Tensor& slot_mapping, double eps, int64_t isa,
                      float* qkv_out) {
  const torch::Tensor& input_norm = w.input_norm;
  const float* q_norm = optional_norm(w.q_norm, s.head_dim, "q_norm");
  const float* k_norm = optional_norm(w.k_norm, s.head_dim, "k_norm");
  TORCH_CHECK((q_norm == nullptr) == (k_norm == nullptr), "fused layer: q_norm and k_norm come together");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && cos.is_contiguous() &&
              sin.is_contiguous() && cos.size(0) == s.M, "fused layer: cos and sin must be contiguous float32 [M, D]");
  TORCH_CHECK(input_norm.scalar_type() == torch::kFloat32, "fused layer: float32 norm weights");
  TORCH_CHECK(v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type(), "fused layer: cache layout");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.size(0) == s.M,
              "fused layer: int64 slot_mapping [M]");
  TORCH_CHECK(lqkv.n == s.q_size + 2 * s.kv_size, "fused layer: QKV projection width");
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat32 || k_cache.scalar_type() == torch::kBFloat16,
              "fused layer: float32 or bfloat16 cache");
  // On AMX the norm writes the product's bfloat16 input itself (packed_gemm.cpp).
  if (!packed_gemm_normed(xp, s.M, s.hidden, input_norm.data_ptr<float>(), static_cast<float>(eps), lqkv.w,
                          lqkv.scale, lqkv.bias, lqkv.n, qkv_out, lqkv.n, isa)) {
    const auto h = scratch_floats(s.M * s.hidden);
    rms_norm(xp, s.M, s.hidden, input_norm.data_ptr<float>(), static_cast<float>(eps), h.get());
    gemm(lqkv, h.get(), s.M, s.hidden, qkv_out, isa, false);
  }
  const float* cos_p = cos.data_ptr<float>();
  const float* sin_p = sin.data_ptr<float>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const bool fp32_cache = k_cache.scalar_type() == torch::kFloat32;
  at::parallel_for(0, s.M, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      float* row = qkv_out + m * lqkv.n;  // q | k | v
      if (q_norm != nullptr) {
        for (int64_t h = 0; h < s.num_heads; ++h)
          rms_norm_row(row + h * s.head_dim, s.head_dim, q_norm, static_cast<float>(eps), row + h * s.head_dim);
        float* k = row + s.q_size;
        for (int64_t h = 0; h < s.num_kv_heads; ++h)
          rms_norm_row(k + h * s.head_dim, s.head_dim, k_norm, static_cast<float>(eps), k + h * s.head_dim);
      }
      rope(row, s.num_heads + s.num_kv_heads, s.head_dim, cos_p + m * s.head_dim, sin_p + m * s.head_dim);
      if (fp32_cache) {
        write_cache(k_cache.data_ptr<float>(), slots[m], s.kv_size, 0, row + s.q_size, s.kv_size);
        write_cache(v_cache.data_ptr<float>(), slots[m], s.kv_size, 0, row + s.q_size + s.kv_size, s.kv_size);
      } else {
        write_cache(k_cache.data_ptr<at::BFloat16>(), slots[m], s.kv_size, 0, row + s.q_size, s.kv_size);
        write_cache(v_cache.data_ptr<at::BFloat16>(), slots[m], s.kv_size, 0, row + s.q_size + s.kv_size, s.kv_size);
      }
    }
  });
}

// A sparse layer's MLP: h [M, hidden] (the normed residual) -> the router's logits, each row's k
// experts and weights, and the experts' weighted sum into out [M, hidden].
void sparse_mlp(const MoeMlp& moe, const float* h, int64_t M, int64_t hidden, float* out, int64_t isa) {
  const LinearView lr = view(moe.router);
  TORCH_CHECK(moe.experts && moe.experts->hidden() == hidden && lr.n == moe.experts->num_experts(),
              "fused layer: the router's outputs must be the experts' count, the experts' width hidden");
  const int64_t E = lr.n, k = moe.top_k;
  const auto logits = scratch_floats(M * E);
  gemm(lr, h, M, hidden, logits.get(), isa, false);
  std::vector<int64_t> ids(M * k);
  std::vector<float> weights(M * k);
  route_tokens(logits.get(), M, E, k, moe.routing, moe.norm_topk_prob, ids.data(), weights.data());
  moe.experts->run(h, M, ids.data(), weights.data(), k, out);
}

// After attention: x += o_proj(attn_out); x += down(act(gate) * up) of RMSNorm(x), or a sparse
// layer's experts of it, each product normed before its add where the layer norms it (Gemma).
// attn_out: [M, q_size]; x: [M, hidden].
void attention_outputs(int64_t M, int64_t hidden, int64_t q_size, float* xp, const float* attn_out,
                       const DecodeLayerWeights& w, double eps, int64_t act, int64_t isa) {
  TORCH_CHECK(w.post_norm.scalar_type() == torch::kFloat32, "fused layer: float32 norm weights");
  const LinearView lo = view(w.o_proj);
  TORCH_CHECK(lo.n == hidden, "fused layer: output projection widths");
  TORCH_CHECK(act == kActSilu || act == kActGeluTanh, "fused layer: unknown activation ", act);
  const float* attn_output_norm = optional_norm(w.attn_output_norm, hidden, "attn_output_norm");
  const float* mlp_output_norm = optional_norm(w.mlp_output_norm, hidden, "mlp_output_norm");
  const auto f_eps = static_cast<float>(eps);
  const auto h = scratch_floats(M * hidden);
  // A product's output, and its residual add: into x directly, or normed first (then h holds it).
  const auto add_product = [&](const LinearView& l, const float* in, int64_t K, const float* output_norm) {
    if (output_norm == nullptr) return gemm(l, in, M, K, xp, isa, true);
    gemm(l, in, M, K, h.get(), isa, false);
    add_rms_normed(h.get(), M, hidden, output_norm, f_eps, xp);
  };
  add_product(lo, attn_out, q_size, attn_output_norm);
  if (w.moe) {
    rms_norm(xp, M, hidden, w.post_norm.data_ptr<float>(), f_eps, h.get());
    const auto y = scratch_floats(M * hidden);
    sparse_mlp(*w.moe, h.get(), M, hidden, y.get(), isa);
    if (mlp_output_norm != nullptr) return add_rms_normed(y.get(), M, hidden, mlp_output_norm, f_eps, xp);
    at::parallel_for(0, M, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin * hidden; i < end * hidden; ++i) xp[i] += y.get()[i];
    });
    return;
  }
  const LinearView lgu = view(w.gate_up), ldown = view(w.down);
  TORCH_CHECK(ldown.n == hidden, "fused layer: output projection widths");
  const int64_t intermediate = lgu.n / 2;
  if (lgu.scale == nullptr && lgu.bias == nullptr && ldown.scale == nullptr && ldown.bias == nullptr &&
      can_run_gated_mlp(lgu.w, intermediate, ldown.w, act, isa)) {
    // On AMX the norm, the activation and the handoff to the down product ride in the products'
    // own passes (packed_gemm.cpp): no float32 normed rows, [M, 2I] product or activation.
    float* dst = mlp_output_norm == nullptr ? xp : h.get();
    packed_gated_mlp(xp, M, hidden, w.post_norm.data_ptr<float>(), f_eps, lgu.w, intermediate, ldown.w, act, dst,
                     hidden, mlp_output_norm == nullptr, isa);
    if (mlp_output_norm != nullptr) add_rms_normed(h.get(), M, hidden, mlp_output_norm, f_eps, xp);
    return;
  }
  rms_norm(xp, M, hidden, w.post_norm.data_ptr<float>(), f_eps, h.get());
  const auto gu = scratch_floats(M * lgu.n), a = scratch_floats(M * intermediate);
  gemm(lgu, h.get(), M, hidden, gu.get(), isa, false);
  at::parallel_for(0, M, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* g = gu.get() + m * lgu.n;
      gated_act(g, g + intermediate, a.get() + m * intermediate, intermediate, act, isa);
    }
  });
  add_product(ldown, a.get(), intermediate, mlp_output_norm);
}

}  // namespace

void decode_layer(torch::Tensor x,                    // [M, hidden] float32, updated in place
                  const torch::Tensor& cos,           // [M, D] float32
                  const torch::Tensor& sin,           // [M, D] float32
                  const DecodeLayerWeights& w,
                  torch::Tensor k_cache,              // [slots, KVH, D]
                  torch::Tensor v_cache,              // [slots, KVH, D]
                  const torch::Tensor& slot_mapping,  // [M] int64
                  const torch::Tensor& block_tables,  // [M, max_blocks] int64
                  const torch::Tensor& context_lens,  // [M] int64
                  int64_t num_heads, int64_t block_size, double eps, double scale, int64_t act, int64_t isa) {
  const LinearView lqkv = view(w.qkv);
  const LayerShapes s = shapes_of(x, k_cache, num_heads);
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && context_lens.scalar_type() == torch::kInt64 &&
              block_tables.is_contiguous(), "decode_layer: int64 block tables and lengths");
  float* xp = x.data_ptr<float>();
  const auto qkv_out = scratch_floats(s.M * lqkv.n), attn_out = scratch_floats(s.M * s.q_size);
  attention_inputs(s, xp, cos, sin, w, lqkv, k_cache, v_cache, slot_mapping, eps, isa, qkv_out.get());
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t max_blocks = block_tables.size(1);
  const int64_t num_threads = std::max<int64_t>(1, at::get_num_threads());
  const DecodeAttentionTasks tasks(lens, s.M, s.num_kv_heads, num_threads);
  std::atomic<int64_t> next_task{0};
  const TeamShare forked{num_threads, &next_task};
  const KvCacheView cache = KvCacheView::of(k_cache, v_cache);
  const float* sinks = sink_logits(w, num_heads, "decode_layer");
  at::parallel_for(0, std::min(num_threads, tasks.size()), 1, [&](int64_t, int64_t) {
    std::vector<float> scratch;
    forked.for_each_task(tasks.size(), [&](int64_t task) {
      const auto [m, num_rows, kv_begin] = tasks[task];  // one row: no chains here
      attend_decode_row(qkv_out.get() + m * lqkv.n, cache, tables + m * max_blocks, lens[m], block_size,
                        static_cast<float>(scale), w.window, num_heads, attn_out.get() + m * s.q_size, scratch,
                        kv_begin, kv_begin + tasks.heads_per_task(), isa, sinks);
    });
  });
  attention_outputs(s.M, s.hidden, s.q_size, xp, attn_out.get(), w, eps, act, isa);
}

torch::Tensor layer_attention_inputs(const torch::Tensor& x,             // [M, hidden] float32
                                     const torch::Tensor& cos,           // [M, D] float32
                                     const torch::Tensor& sin,           // [M, D] float32
                                     const DecodeLayerWeights& w,
                                     torch::Tensor k_cache,              // [slots, KVH, D]
                                     torch::Tensor v_cache,              // [slots, KVH, D]
                                     const torch::Tensor& slot_mapping,  // [M] int64
                                     int64_t num_heads, double eps, int64_t isa) {
  const LinearView lqkv = view(w.qkv);
  const LayerShapes s = shapes_of(x, k_cache, num_heads);
  auto out = scratch_tensor({s.M, lqkv.n}, x.options());  // [M, q | k | v]
  attention_inputs(s, x.data_ptr<float>(), cos, sin, w, lqkv, k_cache, v_cache, slot_mapping, eps, isa,
                   out.data_ptr<float>());
  return out;
}

void layer_attention_outputs(torch::Tensor x,                  // [M, hidden] float32, updated in place
                             const torch::Tensor& attn_out,    // [M, H * D] float32
                             const DecodeLayerWeights& w, double eps, int64_t act, int64_t isa) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2,
              "fused layer: x must be contiguous float32 [M, hidden]");
  TORCH_CHECK(attn_out.scalar_type() == torch::kFloat32 && attn_out.is_contiguous() && attn_out.dim() == 2 &&
              attn_out.size(0) == x.size(0), "fused layer: attn_out must be contiguous float32 [M, H * D]");
  attention_outputs(x.size(0), x.size(1), attn_out.size(1), x.data_ptr<float>(), attn_out.data_ptr<float>(), w, eps,
                    act, isa);
}

}  // namespace minivllm
