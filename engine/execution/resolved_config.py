"""Every "auto" of the EngineConfig settled once, on this machine, into one frozen value.

EngineConfig is the user's word, validated without I/O. What depends on the machine is decided
here, in one pass, and nowhere else: the device (is there a GPU?), the backend, the dtype, the
KV cache's dtype, the C++ CPU kernels (do they build?), their SIMD path (does this CPU run it?),
quantization auto (a .gguf file keeps its blocks where those kernels run) and the CPU threads.
Each choice that cannot be honoured is refused here, once, with the field's name first, so the
backends, the runner and the loader below read a ResolvedConfig and check nothing again.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType, ModuleType

import torch

from engine.config import EngineConfig, Quantization, usable_cpus
from engine.execution import kernels as cpu_kernels
from engine.execution.startup_phases import KERNELS, StartupPhases, timed

_DTYPES = MappingProxyType({"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16})


@dataclass(frozen=True, slots=True)
class ResolvedConfig:
    config: EngineConfig  # the user's, with quantization settled (what the engine reports it serves)
    backend: str  # cpu | cuda | torch
    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    quantization: Quantization  # none | int8 | gguf, never auto
    kernels: ModuleType | None  # the C++ CPU kernels, where this run uses them
    isa: int  # their SIMD path (kernels.ISAS); 0 without them
    num_threads: int  # torch's CPU threads

    def describe(self) -> str:
        """The startup log line: what every auto became."""
        isa = next(name for name, value in cpu_kernels.ISAS.items() if value == self.isa)
        kernels = f"C++ kernels {isa}" if self.kernels is not None else "no C++ kernels"
        return (f"resolved config: backend {self.backend} on {self.device}, dtype {self.dtype}, KV cache "
                f"{self.kv_cache_dtype}, quantization {self.quantization}, {kernels}, {self.num_threads} CPU threads")


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda was asked for but no GPU is available")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # bf16 GEMMs are far slower than fp32 on AVX2 CPUs without bf16 units.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def pick_isa(kernels: ModuleType | None, wanted: str) -> int:
    """The SIMD path of the C++ kernels: the best this CPU runs, or a lower one named by
    kernel_isa (scalar | avx2 | avx512 | avx512_bf16 | amx) to test or compare it.
    avx512_bf16 and amx are AVX-512 whose bfloat16 panels' products run on vdpbf16ps or on the
    AMX tiles (bf16 activations there). The name is checked even without kernels: it is the one
    place kernel_isa is refused."""
    if wanted != "auto" and wanted not in cpu_kernels.ISAS:
        raise ValueError(f"kernel_isa (MINIVLLM_KERNEL_ISA) must be auto, {', '.join(cpu_kernels.ISAS)}, "
                         f"got {wanted!r}")
    if kernels is None:
        return 0
    best = kernels.best_isa()
    if wanted == "auto":
        return best
    if cpu_kernels.ISAS[wanted] > best:
        raise ValueError(f"kernel_isa (MINIVLLM_KERNEL_ISA) {wanted}: this CPU does not run it")
    return cpu_kernels.ISAS[wanted]


def _check_cuda(dtype: torch.dtype) -> None:
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"dtype: the CUDA backend runs bfloat16 or float32, not {dtype}")
    from engine.execution import triton as triton_kernels  # Triton is imported only for a GPU

    if not triton_kernels.is_available():
        raise ValueError("backend: cuda needs Triton (pip install triton matching your torch)")


def resolve_config(config: EngineConfig, phases: StartupPhases | None = None) -> ResolvedConfig:
    """backend auto: CUDA where there is a GPU (or device=cuda), else the CPU backend (with the
    C++ kernels where they build and enable_cpp_kernels); torch: the pure-torch reference.
    Builds the C++ kernels on first use (cached) where the CPU backend would run them (the
    start-up phase `kernels` of phases)."""
    if config.backend == "cpu" and config.device == "cuda":
        raise ValueError("backend: cpu runs on device cpu, not cuda")
    device = pick_device({"cuda": "cuda", "cpu": "cpu"}.get(config.backend, config.device))
    dtype = pick_dtype(config.dtype, device)
    backend = "torch" if config.backend == "torch" else device.type
    asked = Quantization(config.quantization)
    if asked in (Quantization.INT8, Quantization.GGUF) and backend != "cpu":
        raise ValueError(f"quantization: {asked} runs on the CPU backend only")
    if backend == "cuda":
        _check_cuda(dtype)
    kernels = None
    if backend == "cpu" and config.enable_cpp_kernels and dtype in (torch.float32, torch.bfloat16):
        # Looked up on the module at call time: a test stands in for a failed build there.
        with timed(phases, KERNELS):
            kernels = cpu_kernels.load_cpu_kernels()
    isa = pick_isa(kernels, config.kernel_isa)
    quantization = asked
    if asked is Quantization.AUTO:
        # A .gguf model keeps its blocks where the kernels that multiply them run (as vLLM serves a
        # .gguf path as it is); where they fail to build it is served dequantized, not refused.
        is_gguf_file = config.model is not None and config.model.endswith(".gguf")
        quantization = Quantization.GGUF if is_gguf_file and kernels is not None else Quantization.NONE
    elif asked is not Quantization.NONE and kernels is None:
        raise ValueError(f"quantization: {asked} needs the C++ CPU kernels (a compiler, dtype float32 or "
                         "bfloat16, enable_cpp_kernels)")
    kv_cache_dtype = dtype if config.kv_cache_dtype == "auto" else _DTYPES[config.kv_cache_dtype]
    return ResolvedConfig(dataclasses.replace(config, quantization=quantization.value), backend, device, dtype,
                          kv_cache_dtype, quantization, kernels, isa, config.num_threads or usable_cpus())
