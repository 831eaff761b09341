"""Backends behind one interface (backend.py), chosen once from the ResolvedConfig."""
from __future__ import annotations

from engine.config import EngineConfig
from engine.execution.backends.backend import Backend
from engine.execution.models.model_config import ModelConfig
from engine.execution.resolved_config import ResolvedConfig, resolve_config

__all__ = ["Backend", "select_backend"]


def select_backend(config: ResolvedConfig | EngineConfig, model_config: ModelConfig) -> Backend:
    """The backend resolve_config chose (backends/ refuse nothing: the resolver did). An
    EngineConfig is resolved first, for callers that build a backend alone (tests, benches)."""
    resolved = config if isinstance(config, ResolvedConfig) else resolve_config(config)
    if resolved.backend == "torch":
        return Backend(resolved, model_config, resolved.device, resolved.dtype)
    if resolved.backend == "cuda":
        from engine.execution.backends.cuda_backend import CudaBackend

        return CudaBackend(resolved, model_config, resolved.device, resolved.dtype)
    from engine.execution.backends.cpu_backend import CpuBackend

    return CpuBackend(resolved, model_config)
