// A plain read of a decode step's weights, in the step's order and split: the ceiling its memory
// pattern allows. The batch-1 bound divides the weights' bytes by a torch sum's rate over one
// large buffer; a step instead reads about 120 weights of 0.3-57 MB, each split between the
// threads, which wait for each other at every weight's end. On a 2-core Zen 4 this plain read
// got 97-98 % of the sums' rate while they read about 33 GB/s, but 84-86 % in the seconds they
// read 60 (bf16 and fp32 weights), so `bench.offline_throughput --paired-seconds` prints the
// decode against both. A read that ran on past the waits (prefetching the next weight) could
// beat it: this is the pattern's ceiling as the step runs it, not a hard one.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <omp.h>

namespace minivllm {
namespace {

constexpr int64_t kLine = 64;

// XOR of the 8-byte words of p[0:n] (n a multiple of 8), eight independent lanes so the compiler
// keeps several loads in flight.
uint64_t xor_words(const char* p, int64_t n) {
  uint64_t lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const int64_t words = n / 8;
  int64_t i = 0;
  for (; i + 8 <= words; i += 8) {
    for (int64_t j = 0; j < 8; ++j) {
      uint64_t w;
      std::memcpy(&w, p + 8 * (i + j), 8);
      lanes[j] ^= w;
    }
  }
  for (; i < words; ++i) {
    uint64_t w;
    std::memcpy(&w, p + 8 * i, 8);
    lanes[0] ^= w;
  }
  uint64_t out = 0;
  for (const uint64_t lane : lanes) out ^= lane;
  return out;
}

}  // namespace

std::tuple<double, int64_t> stream_weights(const std::vector<torch::Tensor>& weights, bool wait_per_weight) {
  for (const auto& w : weights) TORCH_CHECK(w.is_contiguous(), "stream_weights: contiguous tensors");
  const int num_threads = std::max(1, at::get_num_threads());
  uint64_t checksum = 0;
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(num_threads) reduction(^ : checksum)
  {
    const int64_t rank = omp_get_thread_num(), ranks = omp_get_num_threads();
    for (const auto& w : weights) {
      const auto* data = static_cast<const char*>(w.data_ptr());
      const int64_t bytes = w.numel() * w.element_size(), lines = (bytes + kLine - 1) / kLine;
      // Whole lines per thread, as a product's tasks take whole panels.
      const int64_t begin = std::min(bytes, lines * rank / ranks * kLine);
      const int64_t end = std::min(bytes, lines * (rank + 1) / ranks * kLine);
      const int64_t whole = begin + (end - begin) / 8 * 8;
      checksum ^= xor_words(data + begin, whole - begin);
      if (whole < end) {  // the last bytes of a weight whose size is not a multiple of 8, zero-padded
        uint64_t tail = 0;
        std::memcpy(&tail, data + whole, end - whole);
        checksum ^= tail;
      }
      if (wait_per_weight) {
#pragma omp barrier
      }
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return {seconds, static_cast<int64_t>(checksum)};
}

}  // namespace minivllm
