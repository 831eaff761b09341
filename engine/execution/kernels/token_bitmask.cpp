// Structured output's per-step mask, applied in place on the CPU.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <cstdint>
#include <limits>

namespace minivllm {

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

}  // namespace minivllm
