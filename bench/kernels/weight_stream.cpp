// A plain read of a decode step's weights, in the step's order and split: what its memory
// pattern allows. The batch-1 bound divides the weights' bytes by a torch sum's rate over one
// large buffer; a step instead reads about 120 weights of 0.3-57 MB, each split between the
// threads, which wait for each other at every weight's end, so `bench.offline_throughput
// --paired-seconds` prints the decode against both.
//
// The read's loop must not set the pace itself. Against the sums' rate, 32-byte (AVX2) loads
// came closest, 8-byte and 64-byte (AVX-512) ones well short, so every CPU with AVX2 reads by 32
// bytes. Even so it is a plain read, not a hard ceiling: a one-row product loop over the same
// weights can read faster still.
#include "bench_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <omp.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

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

#if defined(__x86_64__)
// The same XOR by 32-byte (AVX2) loads, four in flight a step; the last bytes (fewer than one
// load) by xor_words. XOR is order-free, so the lanes fold into one word.
__attribute__((target("avx2"))) uint64_t xor_words_avx2(const char* p, int64_t n) {
  const auto load = [p](int64_t i) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)); };
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 128 <= n; i += 128) {
    a0 = _mm256_xor_si256(a0, load(i));
    a1 = _mm256_xor_si256(a1, load(i + 32));
    a2 = _mm256_xor_si256(a2, load(i + 64));
    a3 = _mm256_xor_si256(a3, load(i + 96));
  }
  for (; i + 32 <= n; i += 32) a0 = _mm256_xor_si256(a0, load(i));
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3)));
  uint64_t out = xor_words(p + i, n - i);
  for (const uint64_t lane : lanes) out ^= lane;
  return out;
}
#endif

uint64_t xor_words(const char* p, int64_t n, int64_t isa) {
#if defined(__x86_64__)
  if (isa >= kIsaAvx2) return xor_words_avx2(p, n);  // AVX-512 CPUs too: see the top of the file
#endif
  return xor_words(p, n);
}

}  // namespace

bool cpu_runs(int64_t isa) {
#if defined(__x86_64__)
  if (isa >= kIsaAvx512) return __builtin_cpu_supports("avx512f") && isa <= kIsaAmx;
  if (isa >= kIsaAvx2) return __builtin_cpu_supports("avx2");
#endif
  return isa == kIsaScalar;
}

std::tuple<double, int64_t> stream_weights(const std::vector<torch::Tensor>& weights, bool wait_per_weight,
                                          int64_t isa) {
  TORCH_CHECK(isa >= 0 && cpu_runs(isa), "stream_weights: this CPU lacks the requested instruction set");
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
      checksum ^= xor_words(data + begin, whole - begin, isa);
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
