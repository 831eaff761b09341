"""Measurement kernels for the benchmarks, built apart from the engine's extension: a plain read of
a decode step's weights (`stream_weights`) and the time a cache line takes between two threads'
cores (`core_handoff_ns`). bench.offline_throughput --paired-seconds reads the machine with them.
"""
from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

from engine.execution.kernels import load_extension

_SOURCES = ("bindings.cpp", "weight_stream.cpp", "core_handoff.cpp")


@functools.cache
def load_bench_kernels() -> ModuleType:
    """Built on first use (a compiler is needed: the benchmarks that read these need the engine's
    C++ kernels too)."""
    return load_extension("minivllm_bench_kernels", Path(__file__).parent, _SOURCES)
