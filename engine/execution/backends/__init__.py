"""Backends behind one interface (backend.py), chosen once from the EngineConfig."""
from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.execution.backends.backend import Backend
from engine.execution.models.model_config import ModelConfig

__all__ = ["Backend", "select_backend"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def select_backend(config: EngineConfig, model_config: ModelConfig) -> Backend:
    """backend auto: CUDA where there is a GPU (or device=cuda), else the CPU backend (with the
    C++ kernels where they build and enable_cpp_kernels); torch: the pure-torch reference."""
    if config.backend == "cpu" and config.device == "cuda":
        raise ValueError("backend: cpu runs on device cpu, not cuda")
    device = pick_device({"cuda": "cuda", "cpu": "cpu"}.get(config.backend, config.device))
    dtype = pick_dtype(config.dtype, device)
    if config.quantization in ("int8", "gguf") and (device.type != "cpu" or config.backend == "torch"):
        raise ValueError(f"quantization: {config.quantization} runs on the CPU backend only")
    if config.backend == "torch":
        return Backend(config, model_config, device, dtype)
    if device.type == "cuda":
        from engine.execution.backends.cuda_backend import CudaBackend

        return CudaBackend(config, model_config, device, dtype)
    from engine.execution.backends.cpu_backend import CpuBackend
    from engine.execution.kernels import load_cpu_kernels

    use_kernels = config.enable_cpp_kernels and dtype in (torch.float32, torch.bfloat16)
    return CpuBackend(config, model_config, dtype, load_cpu_kernels() if use_kernels else None)
