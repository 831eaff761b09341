// The extension module: every kernel Python calls, defined in its own file.
//
// The compute kernels release the GIL while they run (they touch no Python object): a serving
// process's asyncio loop then streams the previous step's tokens while the engine thread is in
// a forward, instead of waiting for it to return.
#include "cpu_kernels.h"
#include "quant_tiles.h"

namespace py = pybind11;

namespace {

// Not py::call_guard<gil_scoped_release>: its released region also covers the destruction of
// what pybind11 moved into the call (tensors taken by value, the tuples a PackedLinear is built
// into). A tensor Python also holds gives up its PyObject reference when its C++ count falls
// back to one, and that takes the GIL: one more GIL handoff per such argument, inside the
// kernel's call, a wait whenever the serving loop holds the GIL. Releasing inside the call
// instead lets the arguments die after the GIL is back.
template <typename R, typename... Args>
auto without_gil(R (*kernel)(Args...)) {
  return [kernel](Args... args) -> R {
    py::gil_scoped_release no_gil;
    return kernel(args...);  // copies, not moves: the last reference stays with this frame
  };
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("apply_token_bitmask_", without_gil(&minivllm::apply_token_bitmask_),
        "Mask logits in place by llguidance token bitmasks (CPU, fp32)");
  m.def("paged_decode_attention", without_gil(&minivllm::paged_decode_attention),
        "Paged decode attention (CPU, fp32 or bf16, optional sliding window and per-head sink logits)", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("block_size"), py::arg("scale"), py::arg("window"), py::arg("isa"), py::arg("sinks") = py::none());
  m.def("paged_prefill_attention", without_gil(&minivllm::paged_prefill_attention),
        "Causal attention of one prefill chunk over its paged cache, chunk K/V already written, into out (CPU)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"), py::arg("start_pos"),
        py::arg("block_size"), py::arg("scale"), py::arg("window"), py::arg("isa"), py::arg("out"),
        py::arg("sinks") = py::none());
  m.def("packed_bidirectional_attention", without_gil(&minivllm::packed_bidirectional_attention),
        "An encoder step's attention: each prompt's rows of the fused [T, q | k | v] attend to all of that prompt's "
        "rows, into out [T, H, D] (CPU, float32; bf16_products: K, V, q and the probabilities rounded to bfloat16 "
        "for vdpbf16ps)",
        py::arg("qkv"), py::arg("query_starts"), py::arg("num_heads"), py::arg("scale"), py::arg("isa"),
        py::arg("out"), py::arg("bf16_products") = false);
  m.def("packed_linear_gelu", without_gil(&minivllm::packed_linear_gelu),
        "x [M, K] times float32 or bfloat16 panels plus bias, through GELU (exact, or tanh) -> [M, n] float32, or "
        "with bf16_out bfloat16 (an encoder's up projection)",
        py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("n"), py::arg("isa"), py::arg("is_tanh"),
        py::arg("bf16_out") = false);
  m.def("packed_linear_add_norm_", without_gil(&minivllm::packed_linear_add_norm_),
        "residual = LayerNorm(residual + x times float32 or bfloat16 panels plus bias), in place (an encoder block's "
        "output; x float32, or bfloat16 as packed_linear_gelu's bf16_out gives it)",
        py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("n"), py::arg("isa"), py::arg("residual"),
        py::arg("norm_weight"), py::arg("norm_bias"), py::arg("eps"));
  m.def("release_scratch", &minivllm::release_scratch,
        "Free the step-sized scratch blocks kept between steps (the engine fallen idle); returns their bytes");
  m.def("num_kept_scratch_bytes", &minivllm::num_kept_scratch_bytes, "Bytes of the scratch blocks kept now");
  m.def("best_isa", &minivllm::best_isa,
        "The best SIMD path this CPU runs: 0 scalar, 1 AVX2, 2 AVX-512, 3 AVX-512 + BF16, 4 AVX-512 + AMX");
  m.def("packed_linear", without_gil(&minivllm::packed_linear),
        "x [M, K] times panel-packed weights -> [M, n] float32, or with bf16_out bfloat16 (those values rounded)",
        py::arg("x"), py::arg("w"), py::arg("scale"), py::arg("bias"), py::arg("n"), py::arg("isa"),
        py::arg("bf16_out") = false);
  m.def("quant_linear", without_gil(&minivllm::quant_linear),
        "x [M, K] times GGUF blocks repacked in panels (ggml type) -> [M, n] float32");
  m.def("quant_tile_unpack", without_gil(&minivllm::quant_tile_unpack),
        "Tests: x [rows <= 4, K] by the VNNI tile over the first num_panels panels, K-quant records unpacked with "
        "GFNI or without -> [num_panels, rows, 16] float32",
        py::arg("x"), py::arg("w"), py::arg("type"), py::arg("num_panels"), py::arg("gfni"));
  m.def("quant_tiles_amx", without_gil(&minivllm::quant_tiles_amx),
        "Tests: x [M, K] by the AMX-INT8 tiles alone over every panel -> [M, 16 * panels] float32");
  m.def("can_run_quant_amx", &minivllm::can_run_quant_amx,
        "Whether this CPU runs a ggml type's products of many rows on the AMX-INT8 tiles");
  m.def("quant_rows", without_gil(&minivllm::quant_rows),
        "Rows ids of a quantized weight as float32 [L, k] (an embedding's lookup)");
  m.def("quant_chain_seconds", without_gil(&minivllm::quant_chain_seconds),
        "Seconds per run of a chain of quantized products on one team of threads (benchmarks)", py::arg("x"),
        py::arg("weights"), py::arg("reps"), py::arg("isa"), py::arg("out") = py::none());
  m.def("packed_chain_seconds", without_gil(&minivllm::packed_chain_seconds),
        "Seconds per run of a chain of packed products on one team of threads (benchmarks)", py::arg("x"),
        py::arg("weights"), py::arg("reps"), py::arg("isa"), py::arg("out") = py::none());
  py::class_<minivllm::DecodeLayerWeights, std::shared_ptr<minivllm::DecodeLayerWeights>>(m, "DecodeLayerWeights")
      .def(py::init<torch::Tensor, torch::Tensor, minivllm::PackedLinear, minivllm::PackedLinear,
                    minivllm::PackedLinear, minivllm::PackedLinear, int64_t, std::optional<torch::Tensor>,
                    std::optional<torch::Tensor>, std::optional<torch::Tensor>, std::optional<torch::Tensor>,
                    int64_t>(),  // the struct's fields, in order
           "One layer's norms and packed projections for the fused layers and DecodeModel (made once)")
      .def_readwrite("moe", &minivllm::DecodeLayerWeights::moe,
                     "A sparse layer's MoeMlp (its gate_up and down then empty); None: a dense layer")
      .def_readwrite("sinks", &minivllm::DecodeLayerWeights::sinks,
                     "Each query head's attention sink logit, float32 [num_heads] (gpt-oss); None: no sinks");
  py::class_<minivllm::MoeMlp, std::shared_ptr<minivllm::MoeMlp>>(m, "MoeMlp")
      .def(py::init<minivllm::PackedLinear, std::shared_ptr<minivllm::MoeExperts>, int64_t, int64_t, bool>(),
           py::arg("router"), py::arg("experts"), py::arg("top_k"), py::arg("routing"), py::arg("norm_topk_prob"),
           "A fused layer's sparse MLP: the router's panels, the experts op, the routing (0: softmax then top k, "
           "1: top k then softmax)");
  m.def("decode_layer", without_gil(&minivllm::decode_layer), "One decoder layer of a decode step, in place on x (CPU)");
  py::class_<minivllm::DecodeModel, std::shared_ptr<minivllm::DecodeModel>>(m, "DecodeModel")
      .def(py::init<torch::Tensor, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                    std::vector<std::shared_ptr<minivllm::DecodeLayerWeights>>,
                    std::vector<std::tuple<torch::Tensor, torch::Tensor>>, torch::Tensor, minivllm::PackedLinear,
                    int64_t, int64_t, double, double, int64_t, std::optional<torch::Tensor>,
                    int64_t, std::vector<int64_t>>(),  // the struct's fields, in order
           "A model's decode-only steps: what they share, bound once (CPU)")
      .def("step",
           [](const minivllm::DecodeModel& model, const std::vector<int64_t>& token_ids,
              const std::vector<std::vector<std::vector<int64_t>>>& block_tables,
              const std::vector<int64_t>& context_lens, bool with_argmax) {
             py::gil_scoped_release no_gil;
             return model.step(token_ids, block_tables, context_lens, with_argmax);
           },
           "One decode-only step: last tokens, block tables [groups][tokens], context lengths -> (logits, argmax "
           "or None)")
      .def(
          "take_part_seconds",
          [](const minivllm::DecodeModel& model) {
            const auto [steps, seconds] = model.take_part_seconds();
            static constexpr const char* kNames[] = {"qkv",  "attention", "o_proj", "gate_up", "silu",
                                                     "down", "lm_head",   "argmax", "outside"};
            static_assert(std::size(kNames) == minivllm::DecodeModel::kPartKinds);
            py::dict out;
            out["steps"] = steps;
            for (size_t i = 0; i < std::size(kNames); ++i) out[kNames[i]] = seconds[i];
            return out;
          },
          "The steps' wall seconds by kind of part since the last call, and 'steps'; zeroes them");
  m.def("team_task_order", &minivllm::team_task_order,
        "The order one member of a team alone takes a part's tasks: its home range, then the others' from the back");
  m.def("tapered_split", &minivllm::tapered_split,
        "A team's few-row product's tasks as [begin, end) panels: each rank's home, tasks shrinking to its back");
  py::class_<minivllm::MoeExperts, std::shared_ptr<minivllm::MoeExperts>>(m, "MoeExperts")
      .def(py::init<std::vector<minivllm::PackedLinear>, std::vector<minivllm::PackedLinear>, int64_t, int64_t, int64_t,
                    double, double, int64_t>(),
           py::arg("gate_up"), py::arg("down"), py::arg("hidden"), py::arg("intermediate"), py::arg("act"),
           py::arg("alpha"), py::arg("limit"), py::arg("isa"),
           "A MoE layer's experts' panels, checked and bound once (CPU)")
      .def(
          "forward",
          [](const minivllm::MoeExperts& experts, const torch::Tensor& x, const torch::Tensor& expert_ids,
             const torch::Tensor& weights) {
            py::gil_scoped_release no_gil;
            return experts.forward(x, expert_ids, weights);
          },
          "x [T, hidden], expert_ids [T, k] int64, weights [T, k] -> [T, hidden] float32: each token's routed "
          "experts' weighted outputs summed in ascending expert order")
      .def_property_readonly("num_experts", &minivllm::MoeExperts::num_experts)
      .def_property_readonly("last_num_routed", &minivllm::MoeExperts::last_num_routed,
                             "Distinct experts the last forward ran");
  m.def(
      "moe_route",
      [](const torch::Tensor& logits, int64_t k, int64_t routing, bool norm_topk_prob) {
        TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.is_contiguous(),
                    "moe_route: logits must be contiguous float32 [T, E]");
        auto ids = torch::empty({logits.size(0), k}, torch::kInt64);
        auto weights = torch::empty({logits.size(0), k}, torch::kFloat32);
        minivllm::route_tokens(logits.data_ptr<float>(), logits.size(0), logits.size(1), k, routing, norm_topk_prob,
                               ids.data_ptr<int64_t>(), weights.data_ptr<float>());
        return std::make_tuple(ids, weights);
      },
      "The fused layers' routing (tests): logits [T, E] -> ids [T, k] int64, weights [T, k] float32");
  m.def("layer_attention_inputs", without_gil(&minivllm::layer_attention_inputs),
        "A fused layer up to attention: norm, QKV, RoPE, KV write -> [M, q | k | v] float32 (CPU)");
  m.def("layer_attention_outputs", without_gil(&minivllm::layer_attention_outputs),
        "A fused layer from attention on: o_proj + residual, norm, MLP + residual, in place on x (CPU)");
}
