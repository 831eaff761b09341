// Timed chains of products for the benchmarks (bench/quant_gemm.py): quantized panels and packed
// ones run the same way, one team of threads in one parallel region taking each product's tasks
// (their home ranges, as DecodeModel's members do) and waiting for it to end before the next. So
// the products' weight streams are compared without a fork, a join or Python between them.
#include "cpu_kernels.h"
#include "layer_parts.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>

namespace minivllm {
namespace {

constexpr int64_t kSpins = 1 << 14;

struct alignas(64) PartCounters {
  std::atomic<int64_t> next{0}, done{0};
};

// product(i, team) runs product i's share of this member; every rep runs products 0 .. n - 1.
template <typename Product>
double chain_seconds(int64_t num_products, int64_t reps, const Product& product) {
  const int64_t num_ranks = std::max<int64_t>(1, at::get_num_threads()), num_parts = num_products * reps;
  const std::unique_ptr<PartCounters[]> counters(new PartCounters[num_parts]);
  const std::unique_ptr<HomeRange[]> homes(new HomeRange[num_parts * num_ranks]);
  TeamProgress progress(kSpins);
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, num_ranks, 1, [&](int64_t rank, int64_t) {
    for (int64_t part = 0; part < num_parts; ++part) {
      if (!progress.wait_for(part)) continue;  // done while this member was away
      const TeamShare team{num_ranks, &counters[part].next, &counters[part].done, &progress, part,
                           homes.get() + part * num_ranks, rank};
      product(part % num_products, &team);
    }
  });
  const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
  return elapsed.count() / static_cast<double>(reps);
}

const float* checked_rows(const torch::Tensor& x, int64_t max_k) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous() && x.size(1) >= max_k,
              "chain_seconds: x must be contiguous float32 [M, >= every K]");
  return x.data_ptr<float>();
}

// Where the products write: the caller's out, or scratch.
struct ChainOutput {
  ScratchFloats scratch;
  float* data = nullptr;
  ChainOutput(const std::optional<torch::Tensor>& out, int64_t M, int64_t max_n)
      : scratch(out ? ScratchFloats() : scratch_floats(M * max_n)) {
    TORCH_CHECK(!out || (out->scalar_type() == torch::kFloat32 && out->is_contiguous() && out->numel() >= M * max_n),
                "chain_seconds: out must be contiguous float32 of at least M * every N");
    data = out ? out->data_ptr<float>() : scratch.get();
  }
};

}  // namespace

double quant_chain_seconds(const torch::Tensor& x,
                           const std::vector<std::tuple<torch::Tensor, int64_t, int64_t, int64_t>>& weights,
                           int64_t reps, int64_t isa, const std::optional<torch::Tensor>& out_rows) {
  int64_t max_k = 0, max_n = 0;
  std::vector<QuantPanels> panels;
  for (const auto& [w, type, n, k] : weights) {
    check_quant_weight(w, type, k, n, isa);
    panels.push_back(QuantPanels::of(w, type));
    max_k = std::max(max_k, k);
    max_n = std::max(max_n, n);
  }
  const float* xp = checked_rows(x, max_k);
  const int64_t M = x.size(0), ldx = x.size(1);
  const ChainOutput out(out_rows, M, max_n);
  return chain_seconds(static_cast<int64_t>(weights.size()), reps, [&](int64_t i, const TeamShare* team) {
    const int64_t n = std::get<2>(weights[i]), k = std::get<3>(weights[i]);
    quant_gemm(xp, M, k, ldx, panels[i], nullptr, n, out.data, n, isa, false, team);
  });
}

double packed_chain_seconds(const torch::Tensor& x, const std::vector<std::tuple<PackedLinear, int64_t>>& weights,
                            int64_t reps, int64_t isa, const std::optional<torch::Tensor>& out_rows) {
  int64_t max_k = 0, max_n = 0;
  std::vector<LinearView> views;
  std::vector<PackedPanels> panels;
  for (const auto& [linear, k] : weights) {
    views.push_back(view(linear));
    check_packed_weight(views.back().w, k, views.back().n, views.back().scale, isa);
    panels.push_back(PackedPanels::of(views.back().w));
    max_k = std::max(max_k, k);
    max_n = std::max(max_n, views.back().n);
  }
  const float* xp = checked_rows(x, max_k);
  const int64_t M = x.size(0), ldx = x.size(1);
  const ChainOutput out(out_rows, M, max_n);
  return chain_seconds(static_cast<int64_t>(weights.size()), reps, [&](int64_t i, const TeamShare* team) {
    const LinearView& l = views[i];
    packed_gemm(xp, M, std::get<1>(weights[i]), ldx, panels[i], l.scale, l.bias, l.n, out.data, l.n, isa, false, team);
  });
}

}  // namespace minivllm
