// Measurement kernels for the benchmarks (bench/kernels): not part of the engine's extension.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace minivllm {

// The SIMD paths as the engine's kernels number them (engine/execution/kernels/cpu_kernels.h).
enum Isa : int64_t { kIsaScalar = 0, kIsaAvx2 = 1, kIsaAvx512 = 2, kIsaAvx512Bf16 = 3, kIsaAmx = 4 };

// Whether this CPU runs isa's loads (stream_weights uses AVX2 loads from kIsaAvx2 up).
bool cpu_runs(int64_t isa);

// Reads each weight once, in order, each split in even runs of whole cache lines among
// at::get_num_threads() threads (by 32-byte loads where isa has AVX2); with wait_per_weight the
// threads wait for each other at each weight's end, as a decode step's members do at each
// part's. -> (seconds, XOR of the 8-byte words, a last partial word zero-padded).
std::tuple<double, int64_t> stream_weights(const std::vector<torch::Tensor>& weights, bool wait_per_weight,
                                           int64_t isa);
// Two threads take turns writing one word `rounds` times each -> mean ns for one hand-over.
double core_handoff_ns(int64_t rounds);

}  // namespace minivllm
