// A sparse MoE layer's experts on the CPU: each token's k routed gated MLPs, weighted and summed.
//
// A call reads only the routed experts' panels, each once: the rows (token, slot) are grouped by
// expert (ascending), so an expert's gate_up and down products each run over all its rows as one
// small GEMM (the panel kernels of packed_gemm.cpp, or quant_gemm.cpp's integer-dot tiles for
// GGUF block panels, whose activations are quantized per 32 k once per call, not per task).
// Both products are split into tasks of (expert, row block, panel range) taken from one counter
// by every thread, so at batch 1, where each expert is a GEMV of one row, the threads share the
// k experts' panels instead of waiting on one expert each. Each token's outputs are then added
// in ascending expert order, weight * output, as models/moe.py's Experts does: the sum does not
// depend on the thread split.
#include "cpu_kernels.h"
#include "layer_parts.h"
#include "quant_tiles.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <numeric>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>

#include "simd_exp.h"
#endif

namespace minivllm {
namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kRowBlock = 64;         // rows a task keeps hot while it walks its panels
constexpr int64_t kTasksPerThread = 8;    // per product: a late thread leaves little behind
constexpr int64_t kParallelRows = 16;     // row-wise steps (activation, sum) below this stay on one thread

// One projection of one expert: its panels as plain values (check_packed_weight accepted them).
struct ExpertLinear {
  PackedPanels panels;
  const float* scale;  // int8 panels' per-channel scales, else nullptr
  const float* bias;   // [n] or nullptr
  int64_t panel_bytes() const { return panels.rows * panels.width * c10::elementSize(panels.dtype); }
  bool is_quantized() const { return panels.dtype == at::kByte; }
};

ExpertLinear expert_linear(const PackedLinear& linear, int64_t K, int64_t N, int64_t isa, const char* what) {
  const auto& [w, scale, bias, n] = linear;
  TORCH_CHECK(n == N, "moe_experts: ", what, " has ", n, " outputs, expected ", N);
  TORCH_CHECK(!scale || (scale->scalar_type() == torch::kFloat32 && scale->is_contiguous() &&
                         scale->numel() >= w.size(0) * kPanel),
              "moe_experts: ", what, " scales must be contiguous float32 [ceil(N/16) * 16]");
  TORCH_CHECK(!bias || (bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == N),
              "moe_experts: ", what, " bias must be contiguous float32 [", N, "]");
  const float* s = scale ? scale->data_ptr<float>() : nullptr;
  check_packed_weight(w, K, N, s, isa);
  const PackedPanels panels = PackedPanels::of(w);
  // one block type a product: the tasks index a single run of panels (the loader requantizes mixed parts)
  TORCH_CHECK(panels.num_parts == 0, "moe_experts: ", what, " mixes block types (QuantizedParts); one type only");
  return {panels, s, bias ? bias->data_ptr<float>() : nullptr};
}

// a[i] = (clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha * g'), g' = min(g, limit): gpt-oss's
// clamped SwiGLU, each operation in torch's order (models/moe.py's `gated`); 16 lanes at a time on
// exp512 with AVX-512 (a libm call an element cost as much as the experts' products, as
// decode_layer.cpp found for SiLU), a scalar loop elsewhere and for the tail.
#if defined(__x86_64__)
__attribute__((target("avx512f,fma"))) int64_t swiglu_oai_mul_avx512(const float* g, const float* u, float* a,
                                                                      int64_t n, float alpha, float limit) {
  int64_t i = 0;
  const __m512 one = _mm512_set1_ps(1.f), hi = _mm512_set1_ps(limit), lo = _mm512_set1_ps(-limit);
  const __m512 neg_alpha = _mm512_set1_ps(-alpha);
  for (; i + 16 <= n; i += 16) {
    const __m512 gate = _mm512_min_ps(_mm512_loadu_ps(g + i), hi);
    const __m512 up = _mm512_min_ps(_mm512_max_ps(_mm512_loadu_ps(u + i), lo), hi);
    const __m512 sigmoid = _mm512_div_ps(one, _mm512_add_ps(one, exp512(_mm512_mul_ps(gate, neg_alpha))));
    _mm512_storeu_ps(a + i, _mm512_mul_ps(_mm512_add_ps(up, one), _mm512_mul_ps(gate, sigmoid)));
  }
  return i;
}
#endif

void swiglu_oai_mul(const float* g, const float* u, float* a, int64_t n, float alpha, float limit, int64_t isa) {
  int64_t i = 0;
#if defined(__x86_64__)
  if (isa >= kIsaAvx512) i = swiglu_oai_mul_avx512(g, u, a, n, alpha, limit);
#endif
  for (; i < n; ++i) {
    const float gate = std::min(g[i], limit);
    const float up = std::min(std::max(u[i], -limit), limit);
    const float sigmoid = 1.f / (1.f + std::exp(-(gate * alpha)));
    a[i] = (up + 1.f) * (gate * sigmoid);
  }
}

// Runs f(task) for task < num_tasks on every thread, each taking the next from one counter.
template <typename F>
void run_tasks(int64_t num_tasks, const F& f) {
  if (num_tasks == 0) return;
  const int64_t num_threads = std::min<int64_t>(std::max<int64_t>(1, at::get_num_threads()), num_tasks);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, num_threads, 1, [&](int64_t, int64_t) {
    for (int64_t t; (t = next.fetch_add(1)) < num_tasks;) f(t);
  });
}

// Runs f(begin, end) over rows [0, M): in parallel when there are enough of them.
template <typename F>
void for_rows(int64_t M, const F& f) {
  if (M < kParallelRows) return f(0, M);
  at::parallel_for(0, M, kParallelRows, f);
}

// x [M, K] quantized per 32 k for the integer-dot tiles, in buffers of its own.
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<BlockActs> blocks;
  QuantActs acts{};

  void quantize(const float* x, int64_t M, int64_t K, int64_t isa) {
    const int64_t num_blocks = K / 32;
    q.resize(M * K);
    blocks.resize(M * num_blocks);
    const auto quantize = isa >= kIsaAvx512 ? quantize_rows_avx512 : quantize_rows;
    for_rows(M, [&](int64_t begin, int64_t end) {
      quantize(x + begin * K, end - begin, K, K, q.data() + begin * K, blocks.data() + begin * num_blocks);
    });
    acts = {q.data(), blocks.data(), K, num_blocks};
  }
};

}  // namespace

struct MoeExperts::Plan {
  std::vector<ExpertLinear> gate_up, down;  // per expert
  bool any_quantized_gate_up = false, any_quantized_down = false;
};

MoeExperts::MoeExperts(std::vector<PackedLinear> gate_up, std::vector<PackedLinear> down, int64_t hidden,
                       int64_t intermediate, int64_t act, double alpha, double limit, int64_t isa)
    : gate_up_(std::move(gate_up)), down_(std::move(down)), hidden_(hidden), intermediate_(intermediate), act_(act),
      alpha_(alpha), limit_(limit), isa_(isa) {
  TORCH_CHECK(!gate_up_.empty() && gate_up_.size() == down_.size(),
              "moe_experts: one gate_up and one down per expert, at least one expert");
  TORCH_CHECK(act == kActSilu || act == kActSwigluOai, "moe_experts: activation must be SiLU or gpt-oss's SwiGLU");
  TORCH_CHECK(hidden > 0 && intermediate > 0, "moe_experts: hidden and intermediate sizes must be positive");
  auto plan = std::make_shared<Plan>();
  for (size_t e = 0; e < gate_up_.size(); ++e) {
    plan->gate_up.push_back(expert_linear(gate_up_[e], hidden, 2 * intermediate, isa, "gate_up"));
    plan->down.push_back(expert_linear(down_[e], intermediate, hidden, isa, "down"));
    plan->any_quantized_gate_up |= plan->gate_up.back().is_quantized();
    plan->any_quantized_down |= plan->down.back().is_quantized();
  }
  plan_ = std::move(plan);
}

int64_t MoeExperts::num_experts() const { return static_cast<int64_t>(gate_up_.size()); }

namespace {

// The product of rows [t.m_begin, t.m_end) of x (rows ldx apart; `acts`, the same rows quantized,
// for block panels) and panels [t.p_begin, t.p_end) of w (N outputs) into out's columns of those
// panels, on the calling thread.
void run_product_task(const MoeTask& t, const ExpertLinear& w, const float* x, int64_t K, const QuantActs& acts,
                      int64_t N, float* out, int64_t isa) {
  if (w.is_quantized()) {
    const QuantPanels q{static_cast<const uint8_t*>(w.panels.data), quant_type_of_record(w.panels.width),
                        w.panels.num_panels, w.panels.rows, w.panels.width};
    return quant_gemm_task(acts, q, isa, w.bias, N, out, N, false, t.m_begin, t.m_end, t.p_begin, t.p_end);
  }
  // The panels' range as a weight of its own (panels are contiguous), run by a team of one.
  const int64_t n0 = t.p_begin * kPanel;
  PackedPanels part = w.panels;
  part.data = static_cast<const char*>(w.panels.data) + t.p_begin * w.panel_bytes();
  part.num_panels = t.p_end - t.p_begin;
  std::atomic<int64_t> next{0};
  const TeamShare alone{1, &next};
  packed_gemm(x + t.m_begin * K, t.m_end - t.m_begin, K, K, part, w.scale == nullptr ? nullptr : w.scale + n0,
              w.bias == nullptr ? nullptr : w.bias + n0, std::min(N - n0, part.num_panels * kPanel),
              out + t.m_begin * N + n0, N, isa, false, &alone);
}

// The tasks of one projection over every routed expert: each expert's rows in blocks of
// kRowBlock, its panels in ranges sized so that the whole product has about kTasksPerThread
// tasks per thread. (A task's panel range decides which panels share a tile at several rows,
// and so the last bits of its outputs: the one-call step makes the same tasks for its team.)
void product_tasks(const std::vector<int64_t>& routed, const std::vector<int64_t>& row_begin, int64_t num_panels,
                   int64_t num_threads, std::vector<MoeTask>& tasks) {
  int64_t work = 0;  // panels x row blocks
  for (const int64_t e : routed) work += num_panels * ((row_begin[e + 1] - row_begin[e] + kRowBlock - 1) / kRowBlock);
  const int64_t chunk = std::max<int64_t>(1, work / (kTasksPerThread * std::max<int64_t>(1, num_threads)));
  tasks.clear();
  for (const int64_t e : routed) {
    for (int64_t m = row_begin[e]; m < row_begin[e + 1]; m += kRowBlock) {
      const int64_t m_end = std::min(row_begin[e + 1], m + kRowBlock);
      for (int64_t p = 0; p < num_panels; p += chunk) tasks.push_back({e, m, m_end, p, std::min(num_panels, p + chunk)});
    }
  }
}

}  // namespace

void MoeExperts::group(const int64_t* ids, const float* routing_weights, int64_t T, int64_t k, int64_t num_threads,
                       MoeRows& rows) const {
  const int64_t E = num_experts(), R = T * k;
  rows.T = T;
  rows.k = k;
  rows.row_begin.assign(E + 1, 0);
  for (int64_t i = 0; i < R; ++i) ++rows.row_begin[ids[i] + 1];
  for (int64_t e = 0; e < E; ++e) rows.row_begin[e + 1] += rows.row_begin[e];
  std::vector<int64_t> next_row(rows.row_begin.begin(), rows.row_begin.end() - 1);
  rows.row_token.resize(R);
  rows.row_weight.resize(R);
  rows.token_rows.resize(R);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = next_row[ids[t * k + j]]++;
      rows.row_token[r] = t;
      rows.row_weight[r] = routing_weights[t * k + j];
    }
  }
  {
    std::vector<int64_t> filled(T, 0);
    for (int64_t r = 0; r < R; ++r) rows.token_rows[rows.row_token[r] * k + filled[rows.row_token[r]]++] = r;
  }
  rows.routed.clear();
  for (int64_t e = 0; e < E; ++e)
    if (rows.row_begin[e + 1] > rows.row_begin[e]) rows.routed.push_back(e);
  const int64_t H = hidden_, I = intermediate_;
  product_tasks(rows.routed, rows.row_begin, (2 * I + kPanel - 1) / kPanel, num_threads, rows.gate_up_tasks);
  product_tasks(rows.routed, rows.row_begin, (H + kPanel - 1) / kPanel, num_threads, rows.down_tasks);
}

bool MoeExperts::quantizes_gate_up_input() const { return plan_->any_quantized_gate_up; }

bool MoeExperts::quantizes_down_input() const { return plan_->any_quantized_down; }

void MoeExperts::quantize(const float* x, int64_t M, int64_t K, int8_t* q, BlockActs* blocks) const {
  (isa_ >= kIsaAvx512 ? quantize_rows_avx512 : quantize_rows)(x, M, K, K, q, blocks);
}

void MoeExperts::run_gate_up_task(const MoeRows& rows, int64_t task, const float* xs, const QuantActs& acts,
                                  float* h) const {
  const MoeTask& t = rows.gate_up_tasks[task];
  run_product_task(t, plan_->gate_up[t.expert], xs, hidden_, acts, 2 * intermediate_, h, isa_);
}

void MoeExperts::activate(const float* h, int64_t r_begin, int64_t r_end, float* a) const {
  const int64_t I = intermediate_;
  const auto alpha = static_cast<float>(alpha_), limit = static_cast<float>(limit_);
  for (int64_t r = r_begin; r < r_end; ++r) {
    const float* g = h + r * 2 * I;
    if (act_ == kActSilu)
      silu_mul(g, g + I, a + r * I, I, isa_);
    else
      swiglu_oai_mul(g, g + I, a + r * I, I, alpha, limit, isa_);
  }
}

void MoeExperts::run_down_task(const MoeRows& rows, int64_t task, const float* a, const QuantActs& acts,
                               float* y) const {
  const MoeTask& t = rows.down_tasks[task];
  run_product_task(t, plan_->down[t.expert], a, intermediate_, acts, hidden_, y, isa_);
}

// The compiler may fuse each multiply into its add, so the sum can differ from torch's by a
// rounding (within the tests' 1e-5); both callers run this one loop, so they agree to the bit.
void MoeExperts::sum_token(const MoeRows& rows, const float* y, int64_t t, int64_t c0, int64_t c1, float* out) const {
  const int64_t H = hidden_, k = rows.k;
  std::fill(out + c0, out + c1, 0.f);
  for (int64_t j = 0; j < k; ++j) {
    const int64_t r = rows.token_rows[t * k + j];
    const float* yr = y + r * H;
    const float w = rows.row_weight[r];
    for (int64_t i = c0; i < c1; ++i) out[i] += yr[i] * w;
  }
}

torch::Tensor MoeExperts::forward(const torch::Tensor& x, const torch::Tensor& expert_ids,
                                  const torch::Tensor& weights) const {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden_, "moe_experts: x must be [T, ", hidden_, "]");
  const int64_t T = x.size(0);
  TORCH_CHECK(expert_ids.dim() == 2 && expert_ids.size(0) == T && expert_ids.scalar_type() == torch::kInt64,
              "moe_experts: expert_ids must be int64 [T, k]");
  const int64_t k = expert_ids.size(1);
  TORCH_CHECK(weights.dim() == 2 && weights.size(0) == T && weights.size(1) == k,
              "moe_experts: weights must be [T, k], as expert_ids");
  const auto xf = x.to(torch::kFloat32).contiguous();
  const auto ids_c = expert_ids.contiguous();
  const auto w_c = weights.to(torch::kFloat32).contiguous();
  const int64_t* ids = ids_c.data_ptr<int64_t>();
  const int64_t E = num_experts();
  for (int64_t i = 0; i < T * k; ++i)
    TORCH_CHECK(ids[i] >= 0 && ids[i] < E, "moe_experts: expert id ", ids[i], " outside ", E, " experts");
  auto out = torch::empty({T, hidden_}, torch::kFloat32);  // [T, H]
  run(xf.data_ptr<float>(), T, ids, w_c.data_ptr<float>(), k, out.data_ptr<float>());
  return out;
}

void MoeExperts::run(const float* xp, int64_t T, const int64_t* ids, const float* routing_weights, int64_t k,
                     float* o) const {
  const int64_t H = hidden_, I = intermediate_, R = T * k;
  last_num_routed_ = 0;
  if (R == 0) return (void)std::fill(o, o + T * H, 0.f);

  MoeRows rows;
  group(ids, routing_weights, T, k, std::max<int64_t>(1, at::get_num_threads()), rows);
  last_num_routed_ = static_cast<int64_t>(rows.routed.size());

  const ScratchFloats xs = scratch_floats(R * H), h = scratch_floats(R * 2 * I), a = scratch_floats(R * I),
                      y = scratch_floats(R * H);
  for_rows(R, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) std::copy_n(xp + rows.row_token[r] * H, H, xs.get() + r * H);
  });

  // gate_up: [R, H] -> [R, 2I], each expert's rows against its panels.
  QuantizedRows quantized;
  if (quantizes_gate_up_input()) quantized.quantize(xs.get(), R, H, isa_);
  run_tasks(static_cast<int64_t>(rows.gate_up_tasks.size()),
            [&](int64_t i) { run_gate_up_task(rows, i, xs.get(), quantized.acts, h.get()); });

  // The activation: [R, 2I] (gate half, then up half) -> [R, I].
  for_rows(R, [&](int64_t begin, int64_t end) { activate(h.get(), begin, end, a.get()); });

  // down: [R, I] -> [R, H].
  if (quantizes_down_input()) quantized.quantize(a.get(), R, I, isa_);
  run_tasks(static_cast<int64_t>(rows.down_tasks.size()),
            [&](int64_t i) { run_down_task(rows, i, a.get(), quantized.acts, y.get()); });

  // out[t] = sum over t's experts, ascending, of weight * output.
  for_rows(T, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) sum_token(rows, y.get(), t, 0, H, o + t * H);
  });
}

void route_tokens(const float* logits, int64_t T, int64_t E, int64_t k, int64_t routing, bool norm_topk_prob,
                  int64_t* ids, float* weights) {
  TORCH_CHECK(k > 0 && k <= E, "route_tokens: k must be in 1..", E);
  TORCH_CHECK(routing == kRoutingSoftmaxTopk || routing == kRoutingTopkSoftmax, "route_tokens: unknown routing ", routing);
  std::vector<int64_t> order(E);
  for (int64_t t = 0; t < T; ++t) {
    const float* l = logits + t * E;
    // the top k by logit (softmax is monotonic: the same k as by probability), ties to the lower id
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int64_t a, int64_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
    int64_t* id = ids + t * k;
    float* w = weights + t * k;
    std::copy_n(order.begin(), k, id);
    if (routing == kRoutingTopkSoftmax) {  // softmax over the k chosen logits
      const float top = l[id[0]];
      float sum = 0.f;
      for (int64_t j = 0; j < k; ++j) sum += (w[j] = std::exp(l[id[j]] - top));
      for (int64_t j = 0; j < k; ++j) w[j] /= sum;
      continue;
    }
    // softmax over all E logits, then the k chosen probabilities (renormalised over the k)
    const float top = l[id[0]];
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) sum += std::exp(l[e] - top);
    float chosen = 0.f;
    for (int64_t j = 0; j < k; ++j) chosen += (w[j] = std::exp(l[id[j]] - top) / sum);
    if (norm_topk_prob)
      for (int64_t j = 0; j < k; ++j) w[j] /= chosen;
  }
}

}  // namespace minivllm
