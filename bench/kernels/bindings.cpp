// The benchmarks' measurement kernels as a module of their own (minivllm_bench_kernels).
#include "bench_kernels.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("stream_weights", &minivllm::stream_weights, py::call_guard<py::gil_scoped_release>(),
        "Read weights once in order, split among the threads (waiting at each weight's end) -> (seconds, XOR checksum)");
  m.def("core_handoff_ns", &minivllm::core_handoff_ns, py::call_guard<py::gil_scoped_release>(),
        "Two threads take turns writing one word -> mean ns for a cache line to pass between their cores");
}
