// What the kernel files share: the instruction-set codes, the packed GEMM and one sequence's
// decode attention (each defined in its own .cpp, all linked into one extension module).
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <array>
#include <atomic>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

namespace minivllm {

// Which SIMD code path a kernel runs. Python picks one per engine (the best the CPU has, or a
// lower one to test it) and passes it in: no global switch. kIsaAvx512Bf16 is AVX-512 whose
// bfloat16 weights' products run on vdpbf16ps, kIsaAmx AVX-512 whose run on the AMX tiles (CPUs
// with AMX have AVX512-BF16 too); on both, prefill attention over a bfloat16 cache runs on
// vdpbf16ps; every other kernel runs its AVX-512 path on both.
enum Isa : int64_t { kIsaScalar = 0, kIsaAvx2 = 1, kIsaAvx512 = 2, kIsaAvx512Bf16 = 3, kIsaAmx = 4 };

int64_t best_isa();

// Scratch of at least kPooledBytes (glibc's largest mmap threshold, the engine's while serving)
// comes from blocks kept between steps rather than mapped and faulted in afresh on every call
// (scratch_pool.cpp says why); smaller scratch comes from the heap. take_scratch: 64-byte
// aligned, uninitialized; give_scratch takes it back with the same byte count.
// release_scratch frees every kept block (the engine falling idle) and returns their bytes.
constexpr size_t kPooledBytes = size_t{32} << 20;
void* take_scratch(size_t bytes);
void give_scratch(void* block, size_t bytes);
int64_t release_scratch();
int64_t num_kept_scratch_bytes();
// An uninitialized tensor whose memory comes from take_scratch when large: a product's output.
torch::Tensor scratch_tensor(at::IntArrayRef sizes, const at::TensorOptions& options);
// An uninitialized array of n T from take_scratch, given back when it goes.
template <typename T>
struct ScratchDelete {
  size_t bytes = 0;
  void operator()(T* p) const { give_scratch(p, bytes); }
};
template <typename T>
using Scratch = std::unique_ptr<T[], ScratchDelete<T>>;
template <typename T>
Scratch<T> scratch_array(int64_t n) {
  const size_t bytes = static_cast<size_t>(n) * sizeof(T);
  return Scratch<T>(static_cast<T*>(take_scratch(bytes)), ScratchDelete<T>{bytes});
}

// Below this many rows a decode step is memory bound, and one owner says so for every kernel:
// the product tiles compute each panel alone (no two-panel tiles, whose floats differ), so a
// team's few-row products may split their panels in any way (TaperedSplit), and DecodeModel's
// few-row steps request weights and K/V rows ahead and compute SiLU per member.
constexpr int64_t kFewRows = 4;

// The cache slot of a sequence's token `pos`: its block from the block table, then the row in it.
inline int64_t paged_slot(const int64_t* table, int64_t block_size, int64_t pos) {
  return table[pos / block_size] * block_size + pos % block_size;
}

// How far a team (DecodeModel's step: one parallel region for a whole chain of parts, each
// reading what the one before wrote) has got: parts complete in order, so one number, the parts
// done, says it. A member waits for the part before its next one, not for the other members:
// a member the OS preempts (the server's event loop, a client, more threads than cores) holds
// the others back only while it holds an unfinished task; the rest of the step goes on without
// it. Defined in decode_model.cpp.
class TeamProgress {
 public:
  // stamps, when given: each part's completion time (steady clock, ns), for the step's split.
  explicit TeamProgress(int64_t max_spins, int64_t* stamps = nullptr) : max_spins_(max_spins), stamps_(stamps) {}
  // Marks part `part` done (its last task finished), waking any member asleep on it.
  void complete(int64_t part);
  // Waits until every part before `part` is done; false when `part` itself is done as well
  // (a late member skips it: nothing of it is left to take).
  bool wait_for(int64_t part);

 private:
  alignas(64) std::atomic<int32_t> parts_done_{0};  // a futex word: 32 bits
  alignas(64) std::atomic<int32_t> sleepers_{0};
  const int64_t max_spins_;
  int64_t* const stamps_;
};

// One rank's home range of a part's tasks: its own from the front, in order, and the others'
// from the back once its own are gone. The two counts share one word, so a task is taken once.
struct alignas(64) HomeRange {
  std::atomic<uint64_t> taken{0};  // from the front (low 32 bits), from the back (high 32)
};

// A part's tasks among the threads running it: threads forked for the part alone, or a team's
// members (DecodeModel). num_ranks, the threads, sizes the part's tasks. Without home ranges
// each task goes to whichever thread asks next, from next_task, the part's own counter (zero
// before the part). With them (a team), rank r's home is the r-th of num_ranks even slices of
// the tasks: a member walks its own slice in order, so its weights stream as one run of memory
// (the hardware prefetcher follows one stream a part instead of restarting at each task), then
// takes the others' last tasks. Either way a preempted thread holds back only the task it has.
// In a team, the member that finishes the part's last task (counted in num_done) marks the
// part done in progress.
struct TeamShare {
  int64_t num_ranks;
  std::atomic<int64_t>* next_task;
  std::atomic<int64_t>* num_done = nullptr;  // a team's part: its finished tasks
  TeamProgress* progress = nullptr;
  int64_t part = 0;
  HomeRange* homes = nullptr;  // [num_ranks], or none: every task from next_task
  int64_t rank = 0;            // the asking member's home
  // A team's part: run by the member that finishes its last task, before the part is marked
  // done (a row-wise step on the whole product, such as Gemma's norm of a projection's output
  // and its residual add, without a part of its own); nullptr: none.
  void (*finish)(const void*) = nullptr;
  const void* finish_arg = nullptr;

  template <typename F>
  void for_each_task(int64_t num_tasks, const F& f) const {
    const auto run = [&](int64_t t) {
      f(t);
      if (progress != nullptr && num_done->fetch_add(1) + 1 == num_tasks) complete();
    };
    if (homes != nullptr && num_tasks > 0) {
      for (int64_t t; (t = take(rank, num_tasks, false)) >= 0;) run(t);
      for (int64_t i = 1; i < num_ranks; ++i)
        for (int64_t t; (t = take((rank + i) % num_ranks, num_tasks, true)) >= 0;) run(t);
      return;
    }
    int64_t t = next_task->fetch_add(1);
    if (progress != nullptr && num_tasks == 0 && t == 0) complete();  // once, by the first asker
    for (; t < num_tasks; t = next_task->fetch_add(1)) run(t);
  }

 private:
  void complete() const {
    if (finish != nullptr) finish(finish_arg);
    progress->complete(part);
  }

  // The next task of rank r's home, from its front or its back; -1 when none is left.
  int64_t take(int64_t r, int64_t num_tasks, bool from_back) const {
    const int64_t begin = r * num_tasks / num_ranks, end = (r + 1) * num_tasks / num_ranks;
    std::atomic<uint64_t>& taken = homes[r].taken;
    uint64_t word = taken.load();
    for (;;) {
      const auto front = static_cast<int64_t>(word & 0xFFFFFFFFu), back = static_cast<int64_t>(word >> 32);
      if (begin + front + back >= end) return -1;
      if (taken.compare_exchange_weak(word, word + (from_back ? uint64_t{1} << 32 : uint64_t{1})))
        return from_back ? end - 1 - back : begin + front;
    }
  }
};

// The threads a product's tasks are spread over: a team's members, or this process's threads.
inline int64_t num_workers(const TeamShare* team) {
  return team != nullptr ? team->num_ranks : std::max<int64_t>(1, at::get_num_threads());
}

// The tasks of a part, in the order one member of a team of num_ranks takes them when it runs
// alone: its home range from the front, then each other rank's from the back (tests check the
// home ranges' split and stealing with it).
std::vector<int64_t> team_task_order(int64_t num_tasks, int64_t num_ranks, int64_t rank);
// A team's few-row product of num_panels panels as its tasks' [begin, end) panels, in task order
// (rank r's home is tasks [r T, (r + 1) T), T the same for every home; a home with fewer tasks
// ends in empty ones): packed_gemm.cpp's TaperedSplit, for tests.
std::vector<std::pair<int64_t, int64_t>> tapered_split(int64_t num_panels, int64_t num_ranks);

// A fused projection whose parts are GGUF blocks of different types (a Q4_K_M file's q and k in
// Q4_K, v in Q6_K): row segments of whole panels, each of one type, kept in the file's types
// rather than requantized to one. One uint8 tensor [kQuantPartsHeaderBytes + panels' bytes]: a
// header of int32s, the number of segments and each one's (ggml type, panels, records), then each
// segment's panels (quant_tiles.h's layout) in row order. Its products walk the panels of all
// segments as one run, each panel by its own segment's tiles, so the threads split the whole.
constexpr int64_t kMaxQuantParts = 3;  // q, k, v
constexpr int64_t kQuantPartsHeaderBytes = 64;  // keeps the first segment on the tensor's 64-byte line
struct QuantPart {
  int32_t type = 0, num_panels = 0, num_records = 0;
};

// A packed weight's panels as plain values. A step's team reads these rather than the tensor:
// a tensor's data pointer is a chain of dependent loads (the handle, its impl, the storage)
// that each batch-1 step's weight stream has evicted from every cache since the step before.
struct PackedPanels {
  const void* data = nullptr;
  at::ScalarType dtype = at::kFloat;
  int64_t num_panels = 0, rows = 0, width = 0;  // the tensor's [num_panels, rows, width]
  // GGUF parts of mixed types (data: the first segment's panels, past the header; rows, width 0;
  // num_panels: all segments'); 0 for any other weight.
  int64_t num_parts = 0;
  std::array<QuantPart, kMaxQuantParts> parts{};
  static PackedPanels of(const torch::Tensor& w);  // w as check_packed_weight accepts it
  // Where panel p starts, in bytes from data.
  int64_t panel_offset(int64_t p) const;
};

// out[m, n] = sum_k x[m, k] * W[n, k] * scale[n] + bias[n], for m < M, n < N.
// W is packed in panels of 16 output channels: [ceil(N / 16), K, 16] of float32 or int8 (int8
// needs scale, per output channel), or [ceil(N / 16), Kp / 2, 32] of bfloat16 pairs of k (Kp: K
// rounded up to 32), or GGUF blocks' uint8 panels [ceil(N / 16), records, record bytes] (no
// scale; their type by their record size, quant_tiles.h), which quant_gemm multiplies. x: [M, K] float32 rows ldx apart; out rows ldo apart; accumulate adds into
// out instead (a residual). Panels run in parallel: on threads forked for the call, or, given a
// team, on the team's threads (whose owner has checked w with check_packed_weight: a team's
// member must not throw).
void packed_gemm(const float* x, int64_t M, int64_t K, int64_t ldx, const torch::Tensor& w, const float* scale,
                 const float* bias, int64_t N, float* out, int64_t ldo, int64_t isa, bool accumulate,
                 const TeamShare* team = nullptr);
void check_packed_weight(const torch::Tensor& w, int64_t K, int64_t N, const float* scale, int64_t isa);
// A dense gated MLP's two products, act(h Wg^T) * (h Wu^T) then times Wd^T into out [M, N] (ldo
// apart; N = ldo = the down panels' outputs; accumulated when accumulate), h = x [M, K] (K apart)
// RMS-normed by `norm` (eps) where given, else x: the norm and the rounding to bfloat16 in one
// pass, the activation (kActSilu or kActGeluTanh) in the gate/up product's epilogue and its
// output handed to the down product in bfloat16. Where can_run_gated_mlp says: bfloat16 panels on
// AMX (isa kIsaAmx), I (the intermediate width) a multiple of 16.
bool can_run_gated_mlp(const torch::Tensor& gate_up, int64_t I, const torch::Tensor& down, int64_t act, int64_t isa);
void packed_gated_mlp(const float* x, int64_t M, int64_t K, const float* norm, float eps, const torch::Tensor& gate_up,
                      int64_t I, const torch::Tensor& down, int64_t act, float* out, int64_t ldo, bool accumulate,
                      int64_t isa);
// out = RMSNorm(x) W^T (+ bias) with the norm and the rounding to bfloat16 in one pass (bfloat16
// panels on AMX, no scale); false, and nothing done, elsewhere.
bool packed_gemm_normed(const float* x, int64_t M, int64_t K, const float* norm, float eps, const torch::Tensor& w,
                        const float* scale, const float* bias, int64_t N, float* out, int64_t ldo, int64_t isa);
// What a product's outputs go through once computed (an encoder's MLP: BERT's exact GELU, or
// the tanh approximation).
enum OutputActivation : int64_t { kOutNone = 0, kOutGelu = 1, kOutGeluTanh = 2 };
// y[i] = act(y[i]), i < n: 16 lanes at a time on AVX-512 (isa), a scalar loop elsewhere.
void activate(float* y, int64_t n, int64_t act, int64_t isa);
// packed_gemm over float32 panels (no team), out_act applied to each tile of out in cache.
void packed_gemm_activated(const float* x, int64_t M, int64_t K, int64_t ldx, const torch::Tensor& w,
                           const float* bias, int64_t N, float* out, int64_t ldo, int64_t isa, bool accumulate,
                           int64_t out_act);
#if defined(MINIVLLM_HAS_AMX)
// x [M, K] (rows ldx apart) rounded to nearest-even bfloat16 rows of K rounded up to 16 (zero
// past K), the threads sharing the rows: what the bfloat16 product paths read.
Scratch<uint16_t> round_rows_to_bf16(const float* x, int64_t M, int64_t ldx, int64_t K);
// out[m, :K] = x[m, :K] rounded the same way, on the calling thread (K a multiple of 16; out's rows
// K apart): a row range's rounding done where its floats are still in the core's caches.
void round_rows_into_bf16(const float* x, int64_t M, int64_t ldx, int64_t K, uint16_t* out);
#endif
// out [M, N] bfloat16 = act(x W^T + bias) (act kOutNone, kOutGelu or kOutGeluTanh), rounded as a
// bfloat16 product rounds its input, for bfloat16 panels on AMX with N a multiple of 32 (an
// encoder's up projection and fused QKV); false, and nothing done, elsewhere.
bool packed_gemm_bf16_out(const float* x, int64_t M, int64_t K, const torch::Tensor& w, const float* bias, int64_t N,
                          int64_t act, uint16_t* out, int64_t isa);
// out (+)= xb W^T + bias for xb [M, K] already bfloat16 (K a multiple of 32: no padding to add), on
// bfloat16 panels on AMX; false, and nothing done, elsewhere.
bool packed_gemm_bf16_rows(const uint16_t* xb, int64_t M, int64_t K, const torch::Tensor& w, const float* bias,
                           int64_t N, float* out, int64_t ldo, bool accumulate, int64_t isa);
// The same on checked panels (a team's member: it must not throw).
void packed_gemm(const float* x, int64_t M, int64_t K, int64_t ldx, const PackedPanels& w, const float* scale,
                 const float* bias, int64_t N, float* out, int64_t ldo, int64_t isa, bool accumulate,
                 const TeamShare* team);
// Requests into L2 the first max_bytes of the panels a team member of `rank` starts a few-row
// product on (its home's first task, as tapered_split splits it): a member calls it for the next
// product while the part before finishes, so the product does not start on cold misses while
// the hardware prefetcher ramps up. A no-op off x86.
void prefetch_team_home(const PackedPanels& w, int64_t num_ranks, int64_t rank, int64_t max_bytes);
// A layer's K and V caches ([slots, KV heads, D], float32 or bfloat16, contiguous) as plain
// values, for the same reason as PackedPanels.
struct KvCacheView {
  void *k = nullptr, *v = nullptr;
  bool is_fp32 = true;
  int64_t num_kv_heads = 0, head_dim = 0;
  static KvCacheView of(const torch::Tensor& k_cache, const torch::Tensor& v_cache);  // checks them
  int64_t element_size() const { return is_fp32 ? 4 : 2; }
  int64_t row_bytes() const { return num_kv_heads * head_dim * element_size(); }  // one slot's K (or V)
};
// One sequence's decode attention from the paged cache, for the query heads of KV heads
// [kv_begin, kv_end): q [H, D] float32 -> those heads' rows of out [H, D] float32.
void attend_decode_row(const float* q, const KvCacheView& cache, const int64_t* block_table, int64_t context_len,
                       int64_t block_size, float scale, int64_t window, int64_t num_heads, float* out,
                       std::vector<float>& scratch, int64_t kv_begin, int64_t kv_end, int64_t isa,
                       const float* sinks = nullptr);  // [H] each query head's sink logit, or null

// The Python-facing kernels (bindings.cpp), each documented where it is defined.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size,
                                     double scale, int64_t window, int64_t isa, std::optional<torch::Tensor> sinks);
void paged_prefill_attention(torch::Tensor q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                             const torch::Tensor& block_table, int64_t start_pos, int64_t block_size, double scale,
                             int64_t window, int64_t isa, torch::Tensor out, std::optional<torch::Tensor> sinks);
void packed_bidirectional_attention(const torch::Tensor& qkv, const torch::Tensor& query_starts, int64_t num_heads,
                                    double scale, int64_t isa, torch::Tensor out, bool bf16_products);
torch::Tensor packed_linear_gelu(const torch::Tensor& x, const torch::Tensor& w, const std::optional<torch::Tensor>& bias,
                                 int64_t n, int64_t isa, bool is_tanh, bool bf16_out);
void packed_linear_add_norm_(const torch::Tensor& x, const torch::Tensor& w, const std::optional<torch::Tensor>& bias,
                             int64_t n, int64_t isa, torch::Tensor residual, const torch::Tensor& norm_weight,
                             const torch::Tensor& norm_bias, double eps);
void apply_token_bitmask_(torch::Tensor logits, const torch::Tensor& bitmask, const torch::Tensor& rows);
torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& w, const std::optional<torch::Tensor>& scale,
                            const std::optional<torch::Tensor>& bias, int64_t n, int64_t isa, bool bf16_out);
using PackedLinear = std::tuple<torch::Tensor, std::optional<torch::Tensor>, std::optional<torch::Tensor>, int64_t>;
// A weight of GGUF's quantized blocks, repacked in panels of 16 output channels (quant_tiles.h
// has the layout), as plain values: data [num_panels, num_records, record_bytes] uint8 and its
// ggml type (Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14, MXFP4 39).
struct QuantPanels {
  const uint8_t* data = nullptr;
  int64_t type = 0;
  int64_t num_panels = 0, num_records = 0, record_bytes = 0;
  static QuantPanels of(const torch::Tensor& w, int64_t type);  // w as check_quant_weight accepts it
};
void check_quant_weight(const torch::Tensor& w, int64_t type, int64_t K, int64_t N, int64_t isa);
// The same for mixed-type parts (the uint8 tensor with its header, above): N outputs of K inputs.
void check_quant_parts(const torch::Tensor& w, int64_t K, int64_t N, int64_t isa);
// out[m, n] = sum_k x[m, k] * W[n, k] + bias[n], for m < M, n < N: packed_gemm's contract for
// quantized panels, x quantized per 32 k to int8 on the way in. isa: kIsaAvx512 and up run
// AVX-512 VNNI (AVX2 on a CPU without VNNI), kIsaAvx2 AVX2, kIsaScalar plain C++. A team's
// members must not throw: its owner checks w with check_quant_weight.
void quant_gemm(const float* x, int64_t M, int64_t K, int64_t ldx, const QuantPanels& w, const float* bias, int64_t N,
                float* out, int64_t ldo, int64_t isa, bool accumulate, const TeamShare* team);
// The same over num_parts row segments of whole panels (mixed types), in row order: their panels
// are one run the threads split, each run by its segment's tiles into its own output columns.
void quant_gemm(const float* x, int64_t M, int64_t K, int64_t ldx, const QuantPanels* parts, int64_t num_parts,
                const float* bias, int64_t N, float* out, int64_t ldo, int64_t isa, bool accumulate,
                const TeamShare* team);
// x: [M, K] (any float dtype) -> [M, n] float32 (Python's entry, like packed_linear).
torch::Tensor quant_tile_unpack(const torch::Tensor& x, const torch::Tensor& w, int64_t type, int64_t num_panels,
                                bool gfni);
torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t type,
                           const std::optional<torch::Tensor>& bias, int64_t n, int64_t isa);
// Tests: x [M, K] by the AMX-INT8 tiles alone over every panel of w -> [M, 16 * panels] float32
// (no bias); refused where the CPU or the type has none (can_run_quant_amx).
torch::Tensor quant_tiles_amx(const torch::Tensor& x, const torch::Tensor& w, int64_t type);
// out[i, :k] = row ids[i] of checked quantized panels of k inputs (each id < the panels' rows), as
// the gguf package dequantizes it: an embedding's lookup (quant_rows, DecodeModel's step).
void quant_gather_rows(const QuantPanels& w, const int64_t* ids, int64_t L, int64_t k, float* out);
// Rows `ids` ([L] int64, each < n) of a quantized weight of k inputs, float32 [L, k]: an
// embedding's lookup, each value the gguf package's dequantization of it.
torch::Tensor quant_rows(const torch::Tensor& w, int64_t type, const torch::Tensor& ids, int64_t n, int64_t k);
// Benchmarks: `reps` runs of a chain of products (weights[i] against x's first K_i columns),
// each product's tasks shared by a team of at::get_num_threads() threads in one parallel region
// that wait for each product's end before the next, as DecodeModel's members do -> seconds per
// run. Quantized weights are (data, ggml type, N, K), packed ones PackedLinear with their K. out,
// when given (float32, >= M * every N), holds the last product's [M, N] output first (tests: the
// team's share).
double quant_chain_seconds(const torch::Tensor& x, const std::vector<std::tuple<torch::Tensor, int64_t, int64_t, int64_t>>& weights,
                           int64_t reps, int64_t isa, const std::optional<torch::Tensor>& out);
double packed_chain_seconds(const torch::Tensor& x, const std::vector<std::tuple<PackedLinear, int64_t>>& weights,
                            int64_t reps, int64_t isa, const std::optional<torch::Tensor>& out);
// The gated MLP's activation: act(gate) * up (SwiGLU; Gemma's GeGLU with tanh GELU).
// kActSwigluOai: gpt-oss's clamped SwiGLU, (clamp(up) + 1) * g sigmoid(alpha g), g = min(gate, limit):
// MoeExperts' only (the dense layers' gated_act runs the first two).
enum Activation : int64_t { kActSilu = 0, kActGeluTanh = 1, kActSwigluOai = 2 };
struct MoeExperts;
// How a sparse layer's router logits pick and weigh a token's k experts (models/moe.py's ROUTINGS):
// Qwen3-MoE's softmax over all E then the top k (renormalised over the k where norm_topk_prob is
// set); gpt-oss's top k logits then a softmax over those k.
enum Routing : int64_t { kRoutingSoftmaxTopk = 0, kRoutingTopkSoftmax = 1 };
// A fused layer's sparse MLP in place of the dense one: the router's panels (N = E, K = hidden,
// its bias in the PackedLinear), the experts op, and the routing.
struct MoeMlp {
  PackedLinear router;
  std::shared_ptr<MoeExperts> experts;
  int64_t top_k;
  int64_t routing;  // Routing
  bool norm_topk_prob;
};
// logits [T, E] -> each token's k expert ids (descending by logit) and their weights [T, k].
void route_tokens(const float* logits, int64_t T, int64_t E, int64_t k, int64_t routing, bool norm_topk_prob,
                  int64_t* ids, float* weights);
// One layer's weights, made once when the weights are packed (the caches and the step's tensors
// come with each call): DecodeModel's layers, and the per-layer kernels' (decode_layer,
// layer_attention_inputs / _outputs). The optional norms are the families' beyond Llama's.
// A mixture-of-experts layer sets `moe` and leaves gate_up and down empty (out_features 0);
// both the per-layer kernels and DecodeModel's one-call step take such layers.
struct DecodeLayerWeights {
  torch::Tensor input_norm, post_norm;  // [hidden] float32; post_norm: the MLP's input norm
  PackedLinear qkv, o_proj, gate_up, down;
  int64_t window;  // sliding window, 0 for none
  // RMSNorm over each head of q and of k before RoPE (Qwen3, Gemma 3): [head_dim] float32 each.
  std::optional<torch::Tensor> q_norm, k_norm;
  // Gemma's norms of o_proj's and down's outputs before their residual adds: [hidden] float32.
  std::optional<torch::Tensor> attn_output_norm, mlp_output_norm;
  int64_t rope_index;  // which of the model's RoPE tables the layer reads (DecodeModel)
  std::shared_ptr<MoeMlp> moe;  // set after construction (Python: weights.moe = MoeMlp(...)); none: dense
  // gpt-oss's attention sinks: each query head's sink logit [num_heads] float32, in its softmax's
  // denominator; set after construction (Python: weights.sinks = ...); none: no sinks.
  std::optional<torch::Tensor> sinks;
};
// w's sink logits for the attention kernels (checked: float32 [num_heads], contiguous), or nullptr.
inline const float* sink_logits(const DecodeLayerWeights& w, int64_t num_heads, const char* what) {
  if (!w.sinks) return nullptr;
  TORCH_CHECK(w.sinks->scalar_type() == torch::kFloat32 && w.sinks->is_contiguous() && w.sinks->dim() == 1 &&
              w.sinks->numel() == num_heads, what, ": a layer's sinks must be contiguous float32 [num_heads]");
  return w.sinks->data_ptr<float>();
}
void decode_layer(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin, const DecodeLayerWeights& w,
                  torch::Tensor k_cache, torch::Tensor v_cache, const torch::Tensor& slot_mapping,
                  const torch::Tensor& block_tables, const torch::Tensor& context_lens, int64_t num_heads,
                  int64_t block_size, double eps, double scale, int64_t act, int64_t isa);
// A model's decode-only steps from token ids to logits, one call each (the CPU counterpart of a
// CUDA graph; decode_model.cpp): the embedding's rows (float32, bfloat16 or float16; scaled where
// the family scales them) and each RoPE table's rows of the positions, every layer as
// decode_layer computes it (a sparse layer's router, routing and routed experts too), the final
// RMSNorm, the LM head's panels, all in one parallel region whose threads take each part's tasks
// in turn.
// What every step shares is bound and checked once, not converted from Python per step (this,
// and taking the sequences' lists as inputs, took much of a batch-1 step's host part away).
struct DecodeModel {
  torch::Tensor embedding;           // [vocab, hidden], or the tied LM head's float32 / bfloat16 panels
  std::vector<torch::Tensor> rope_cos, rope_sin;  // per rope (a layer's rope_index), [max_positions, D / 2] float32
  std::vector<std::shared_ptr<DecodeLayerWeights>> layers;
  std::vector<std::tuple<torch::Tensor, torch::Tensor>> kv_caches;  // per layer, [slots, KVH, D] each
  torch::Tensor final_norm;          // [hidden] float32
  PackedLinear lm_head;
  int64_t num_heads, block_size;
  double eps, scale;
  int64_t act;  // Activation
  // Gemma's embedding scale: a 0-d tensor of the model's dtype, whose value multiplies each
  // embedding row as it does in torch (the row in that dtype times it, rounded to it); none: unscaled.
  std::optional<torch::Tensor> embed_scale;
  int64_t isa;
  std::vector<int64_t> layer_groups;  // per layer, its KV-cache group (engine/execution/kv_cache_layout.py)
  // Derived from the above by the constructor (intermediate: the dense layers' MLP width, 0 where
  // every layer is sparse).
  int64_t hidden, head_dim, num_kv_heads, qkv_width, intermediate, num_groups;
  bool has_output_norms;  // some layer norms its o_proj's and down's outputs (a scratch for them)

  DecodeModel(torch::Tensor embedding, std::vector<torch::Tensor> rope_cos, std::vector<torch::Tensor> rope_sin,
              std::vector<std::shared_ptr<DecodeLayerWeights>> layers,
              std::vector<std::tuple<torch::Tensor, torch::Tensor>> kv_caches, torch::Tensor final_norm,
              PackedLinear lm_head, int64_t num_heads, int64_t block_size, double eps, double scale, int64_t act,
              std::optional<torch::Tensor> embed_scale, int64_t isa, std::vector<int64_t> layer_groups);

  // token_ids, context_lens: one per sequence; block_tables: [groups][sequences], each
  // sequence's blocks in each KV-cache group (Python lists, as the sequences hold them: each
  // token is at its context's last position) ->
  // logits [M, vocab] float32 and, with_argmax, each row's first maximum (torch.argmax's rule:
  // a greedy step's tokens) as a list for Python, not a tensor: after a batch-1 step's weight
  // stream a tensor's tolist() ran cold in the engine's host code.
  std::tuple<torch::Tensor, std::optional<std::vector<int64_t>>> step(
      const std::vector<int64_t>& token_ids, const std::vector<std::vector<std::vector<int64_t>>>& block_tables,
      const std::vector<int64_t>& context_lens, bool with_argmax) const;

  // The steps' wall time by kind of part, summed since the last call, and how many steps: a
  // layer's six (kQkv .. kDown's order; a sparse layer's router and experts' gate_up count as
  // gate_up, their activation as silu, their down products and weighted sum as down), the LM
  // head, the argmax, and outside the team (the inputs' checks and gathers). A part's time runs from the part before's completion to its
  // own, so the kinds add up to the step, waits included. Reading zeroes the sums.
  static constexpr int64_t kPartKinds = 9;
  std::pair<int64_t, std::array<double, kPartKinds>> take_part_seconds() const;

  // Every pointer and size a step's members read, as plain values in one array (the layers',
  // then the head's; decode_model.cpp), made by the constructor.
  struct Plan;

 private:
  std::shared_ptr<const Plan> plan_;
  mutable std::array<double, kPartKinds> part_seconds_{};  // steps run on one thread at a time
  mutable int64_t num_timed_steps_ = 0;
};
// The same layer in two halves around an attention computed elsewhere (steps with prefill rows:
// engine/execution/attention.py's `attention`, whose chunks attend through the C++ prefill kernel or flash).
torch::Tensor layer_attention_inputs(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                     const DecodeLayerWeights& w, torch::Tensor k_cache, torch::Tensor v_cache,
                                     const torch::Tensor& slot_mapping, int64_t num_heads, double eps, int64_t isa);
void layer_attention_outputs(torch::Tensor x, const torch::Tensor& attn_out, const DecodeLayerWeights& w, double eps,
                             int64_t act, int64_t isa);

struct BlockActs;  // quant_tiles.h: activations quantized per 32 k for GGUF block panels
struct QuantActs;

// One routed expert's rows and a range of one of its projections' panels: a task of MoeExperts' products.
struct MoeTask {
  int64_t expert, m_begin, m_end, p_begin, p_end;
};

// A call's routes as rows (token, slot) grouped by expert (ascending; tokens in order within an
// expert) and each product's tasks (MoeExperts::group): what MoeExperts::run and DecodeModel's
// sparse layers share, so that both run the same tasks and sum each token's outputs in the same
// order (the same floats).
struct MoeRows {
  int64_t T = 0, k = 0;
  std::vector<int64_t> ids;         // [T, k]: DecodeModel's routing (run() takes its caller's)
  std::vector<float> weights;       // [T, k]
  std::vector<int64_t> row_begin;   // [E + 1]: expert e's rows are [row_begin[e], row_begin[e + 1])
  std::vector<int64_t> row_token;   // [T k]: each row's token
  std::vector<float> row_weight;    // [T k]: each row's routing weight
  std::vector<int64_t> token_rows;  // [T, k]: token t's rows, in ascending expert order
  std::vector<int64_t> routed;      // the experts with rows, ascending
  std::vector<MoeTask> gate_up_tasks, down_tasks;
  int64_t num_rows() const { return T * k; }
};

// A sparse MoE layer's E experts (moe_experts.cpp), bound once: per expert its gate_up
// projection (K = hidden, N = 2 intermediate: the gate rows, then the up rows) and its down
// projection (K = intermediate, N = hidden), each as a PackedLinear of float32, bfloat16 or int8
// panels or GGUF block panels (uint8, their type by their record size), biases in the
// PackedLinear. forward(x [T, hidden] any float, expert_ids [T, k] int64, weights [T, k]) ->
// [T, hidden] float32: sum over each token's experts, ascending, of weight * down(act(gate_up(x))),
// reading only the routed experts' panels, each once a call.
struct MoeExperts {
  MoeExperts(std::vector<PackedLinear> gate_up, std::vector<PackedLinear> down, int64_t hidden, int64_t intermediate,
             int64_t act, double alpha, double limit, int64_t isa);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& expert_ids, const torch::Tensor& weights) const;
  // forward on raw rows: x [T, hidden] float32, ids [T, k] (each in [0, E)), weights [T, k] -> out [T, hidden].
  void run(const float* x, int64_t T, const int64_t* ids, const float* weights, int64_t k, float* out) const;
  int64_t num_experts() const;
  int64_t hidden() const { return hidden_; }
  // Distinct experts the last forward ran (its grouping counts them anyway: the step's stats read
  // it), or the last DecodeModel step ran in this layer (which sets it).
  int64_t last_num_routed() const { return last_num_routed_; }
  void set_last_num_routed(int64_t n) const { last_num_routed_ = n; }
  int64_t intermediate() const { return intermediate_; }

  // run()'s pieces, for a team that runs them as parts of its own (DecodeModel's step); a
  // member must not throw, and none of these does.
  // T tokens' k routes (ids each in [0, E)) as rows, with each product's tasks for num_threads threads.
  void group(const int64_t* ids, const float* weights, int64_t T, int64_t k, int64_t num_threads,
             MoeRows& rows) const;
  // Whether a product's input rows must come quantized per 32 k (some expert's panels are GGUF blocks).
  bool quantizes_gate_up_input() const;
  bool quantizes_down_input() const;
  // x [M, K] -> q [M, K], blocks [M, K / 32], as the integer-dot tiles take them.
  void quantize(const float* x, int64_t M, int64_t K, int8_t* q, BlockActs* blocks) const;
  // One task of the gate_up product: xs [R, hidden] (acts: xs quantized, where the panels need
  // it) -> its outputs in h [R, 2 intermediate].
  void run_gate_up_task(const MoeRows& rows, int64_t task, const float* xs, const QuantActs& acts, float* h) const;
  // Rows [r_begin, r_end) of h [R, 2 intermediate] (gate half, then up half) -> a [R, intermediate].
  void activate(const float* h, int64_t r_begin, int64_t r_end, float* a) const;
  // One task of the down product: a [R, intermediate] -> its outputs in y [R, hidden].
  void run_down_task(const MoeRows& rows, int64_t task, const float* a, const QuantActs& acts, float* y) const;
  // out[c0, c1) of token t = sum over t's experts, ascending, of weight * y's row (out: t's
  // output row of hidden floats).
  void sum_token(const MoeRows& rows, const float* y, int64_t t, int64_t c0, int64_t c1, float* out) const;

  struct Plan;  // the panels as plain values (moe_experts.cpp)

 private:
  std::vector<PackedLinear> gate_up_, down_;  // keep the panels alive
  int64_t hidden_, intermediate_, act_;
  double alpha_, limit_;  // kActSwigluOai's
  int64_t isa_;
  std::shared_ptr<const Plan> plan_;
  mutable int64_t last_num_routed_ = 0;
};

}  // namespace minivllm
