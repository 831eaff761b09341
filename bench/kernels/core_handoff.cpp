// How long a cache line takes to pass from one thread's core to another's: two threads take
// turns writing one shared word, each spinning until the other's write shows.
//
// A batch-1 decode step hands its activations between its two threads at every part's end, so
// this sets the price of the step's ~180 hand-overs. On the 2-vCPU VMs this repository was
// measured on it is bimodal, and the slow hand-overs came with the fast memory reads: by our
// reading the two vCPUs then sit on two chiplets, each with its own link to memory and its own
// L3, instead of sharing one. `bench.offline_throughput --paired-seconds` prints it per band of
// the sums' rate.
#include "bench_kernels.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <chrono>
#include <omp.h>
#include <thread>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace minivllm {

double core_handoff_ns(int64_t rounds) {
  TORCH_CHECK(rounds > 0, "core_handoff_ns: rounds must be positive");
  TORCH_CHECK(at::get_num_threads() >= 2, "core_handoff_ns: needs two threads (torch.set_num_threads)");
  struct alignas(64) Turn {
    std::atomic<int64_t> value{0};
  } turn;
  double seconds = 0;
#pragma omp parallel num_threads(2)
  {
    const int64_t rank = omp_get_thread_num();
#pragma omp barrier
    const auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < rounds; ++i) {
      const int64_t mine = 2 * i + rank;  // rank 0 writes the odd values, rank 1 the even ones
      for (int64_t spins = 1; turn.value.load(std::memory_order_acquire) != mine; ++spins) {
#if defined(__x86_64__)
        _mm_pause();
#endif
        if (spins % 4096 == 0) std::this_thread::yield();  // the other thread may wait for this core
      }
      turn.value.store(mine + 1, std::memory_order_release);
    }
    if (rank == 0) seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  return seconds * 1e9 / static_cast<double>(2 * rounds);  // each round: two hand-overs
}

}  // namespace minivllm
