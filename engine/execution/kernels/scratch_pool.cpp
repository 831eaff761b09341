// Step-sized scratch blocks kept for the next step instead of handed back to the C library.
//
// Why: glibc maps every allocation of at least its mmap threshold (32 MiB at most) on its own and
// unmaps it when freed, so a prefill step's larger buffers (a 2,048-token step of
// Qwen3-Embedding-0.6B's shape: the gate/up product 50 MB, the fused q/k/v 34 MB, in each of
// 28 layers) were mapped, faulted in page by page (the kernel zeroing each) and unmapped again,
// layer after layer: 0.7 M page faults in 12 s of steps. Kept here, a block is faulted in once.
// What is kept goes back when the engine falls idle (release_scratch), so an idle server holds
// none of it.
#include "cpu_kernels.h"

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

namespace minivllm {
namespace {

constexpr size_t kBlockAlign = size_t{2} << 20;  // blocks in whole 2 MiB units: sizes a step repeats match
constexpr size_t kMaxKeptBlocks = 8;  // more than the large buffers any step holds at once

size_t block_bytes(size_t bytes) { return (bytes + kBlockAlign - 1) / kBlockAlign * kBlockAlign; }

// The free blocks, (bytes, block). A mutex: a tensor's block may come back on any thread.
struct KeptBlocks {
  std::mutex mutex;
  std::vector<std::pair<size_t, void*>> blocks;
};

KeptBlocks& kept() {
  static KeptBlocks instance;  // one per process: what it keeps is the process's memory
  return instance;
}

}  // namespace

void* take_scratch(size_t bytes) {
  if (bytes < kPooledBytes) return ::operator new[](bytes, std::align_val_t{64});
  const size_t size = block_bytes(bytes);
  {
    KeptBlocks& k = kept();
    const std::lock_guard<std::mutex> lock(k.mutex);
    // the smallest kept block that holds it
    auto best = k.blocks.end();
    for (auto it = k.blocks.begin(); it != k.blocks.end(); ++it) {
      if (it->first >= size && (best == k.blocks.end() || it->first < best->first)) best = it;
    }
    if (best != k.blocks.end()) {
      void* block = best->second;
      k.blocks.erase(best);
      return block;
    }
  }
  void* block = nullptr;
  if (posix_memalign(&block, kBlockAlign, size) != 0) throw std::bad_alloc();
  return block;
}

void give_scratch(void* block, size_t bytes) {
  if (block == nullptr) return;
  if (bytes < kPooledBytes) return ::operator delete[](block, std::align_val_t{64});
  void* dropped = nullptr;
  {
    KeptBlocks& k = kept();
    const std::lock_guard<std::mutex> lock(k.mutex);
    k.blocks.emplace_back(block_bytes(bytes), block);
    if (k.blocks.size() > kMaxKeptBlocks) {  // the smallest goes: the larger serve more requests
      const auto smallest = std::min_element(k.blocks.begin(), k.blocks.end());
      dropped = smallest->second;
      k.blocks.erase(smallest);
    }
  }
  std::free(dropped);
}

int64_t release_scratch() {
  std::vector<std::pair<size_t, void*>> blocks;
  {
    KeptBlocks& k = kept();
    const std::lock_guard<std::mutex> lock(k.mutex);
    blocks.swap(k.blocks);
  }
  int64_t released = 0;
  for (const auto& [size, block] : blocks) {
    std::free(block);
    released += static_cast<int64_t>(size);
  }
  return released;
}

int64_t num_kept_scratch_bytes() {
  KeptBlocks& k = kept();
  const std::lock_guard<std::mutex> lock(k.mutex);
  int64_t total = 0;
  for (const auto& [size, block] : k.blocks) total += static_cast<int64_t>(size);
  return total;
}

torch::Tensor scratch_tensor(at::IntArrayRef sizes, const at::TensorOptions& options) {
  const int64_t numel = c10::multiply_integers(sizes);
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  if (bytes < kPooledBytes) return torch::empty(sizes, options);
  void* block = take_scratch(bytes);
  return torch::from_blob(block, sizes, [bytes](void* data) { give_scratch(data, bytes); }, options);
}

}  // namespace minivllm
