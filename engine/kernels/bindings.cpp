// The extension module: every kernel Python calls, defined in its own file.
//
// The compute kernels release the GIL while they run (they touch no Python object): a serving
// process's asyncio loop then streams the previous step's tokens while the engine thread is in
// a forward, instead of waiting for it to return.
#include "cpu_kernels.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("apply_token_bitmask_", &minivllm::apply_token_bitmask_,
        "Mask logits in place by llguidance token bitmasks (CPU, fp32)", no_gil);
  m.def("paged_decode_attention", &minivllm::paged_decode_attention,
        "Paged decode attention (CPU, fp32 or bf16, optional sliding window)", no_gil);
  m.def("paged_prefill_attention", &minivllm::paged_prefill_attention,
        "Causal attention of one prefill chunk over its paged cache, chunk K/V already written, into out (CPU)",
        no_gil);
  m.def("best_isa", &minivllm::best_isa,
        "The best SIMD path this CPU runs: 0 scalar, 1 AVX2, 2 AVX-512, 3 AVX-512 + AMX");
  m.def("packed_linear", &minivllm::packed_linear, "x [M, K] times panel-packed weights -> [M, n] float32", no_gil);
  m.def("decode_layer", &minivllm::decode_layer, "One decoder layer of a decode step, in place on x (CPU)", no_gil);
  m.def("layer_attention_inputs", &minivllm::layer_attention_inputs,
        "A fused layer up to attention: norm, QKV, RoPE, KV write -> [M, q | k | v] float32 (CPU)", no_gil);
  m.def("layer_attention_outputs", &minivllm::layer_attention_outputs,
        "A fused layer from attention on: o_proj + residual, norm, MLP + residual, in place on x (CPU)", no_gil);
}
