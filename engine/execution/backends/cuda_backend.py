"""The CUDA backend: bfloat16 (or float32) weights on the GPU through torch/cuBLAS GEMMs, paged
attention in Triton over the engine's own block tables, the KV pool sized from free GPU memory
(gpu_memory_utilization, vLLM's name), and decode steps replayed from CUDA graphs, one per
batch-size bucket (enforce_eager turns them off). Prefill and mixed steps run eagerly through the
same model forward as on the CPU; sampling stays on the GPU with one host sync per step.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from engine.execution.backends.backend import Backend
from engine.execution.backends.cuda_graphs import DecodeGraphs, decode_buckets
from engine.execution.backends.cuda_pointwise import swap_pointwise_modules
from engine.execution.backends.triton_attention import TritonAttention
from engine.execution.models.model_config import ModelConfig
from engine.execution.resolved_config import ResolvedConfig

logger = logging.getLogger(__name__)

# What the KV pool leaves free beyond the weights: activations of the largest step, the graphs'
# memory pool, the sampler's [rows, vocab] tensors and cuBLAS workspaces.
_ACTIVATION_RESERVE_BYTES = 2 << 30


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self, resolved: ResolvedConfig, model_config: ModelConfig, device: torch.device,
                 dtype: torch.dtype) -> None:
        # dtype and Triton were checked by resolve_config
        super().__init__(resolved, model_config, device, dtype)
        self.attention = TritonAttention()
        self.graphs: DecodeGraphs | None = None

    def prepare(self, model: nn.Module) -> None:
        """The elementwise layers (norms, RoPE, SiLU * up) as one Triton kernel each
        (cuda_pointwise.py): a decode step's kernels are what it costs."""
        logger.info("%d norm, rotation and activation modules on Triton kernels", swap_pointwise_modules(model))

    def kv_cache_bytes(self) -> int:
        """gpu_memory_utilization of the device, less what this process holds already (the
        weights) and a reserve for activations and graphs; never more than is free."""
        free, total = torch.cuda.mem_get_info(self.device)
        budget = int(total * self.config.gpu_memory_utilization) - torch.cuda.memory_allocated(self.device)
        budget = min(budget, free) - _ACTIVATION_RESERVE_BYTES
        if budget <= 0:
            raise ValueError(f"gpu_memory_utilization: {self.config.gpu_memory_utilization} of "
                             f"{total / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free) leaves no room for the KV cache "
                             "after the weights")
        return budget

    def allocate_kv_cache(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The pool and one scratch block past it: padded rows of a captured decode write there."""
        layers, kv, slots, heads, dim = shape
        self.num_slots = slots
        pool = torch.zeros(layers, kv, slots + self.config.block_size, heads, dim, dtype=self.cache_dtype,
                           device=self.device)
        return pool[:, :, :slots]

    def bind_kv_cache(self, model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      block_size: int, layer_group: tuple[int, ...]) -> None:
        if self.config.enforce_eager:
            return
        if not self.model_config.is_causal:  # an encoder never decodes: whole prompts, eager
            return
        if self.model_config.moe is not None:
            # models/moe.py's experts group their rows on the host (a sync a layer no graph can
            # capture): mixture-of-experts models run eager until a device-side expert kernel exists.
            logger.info("model with mixture-of-experts layers: decode steps run eagerly (no CUDA graphs)")
            return
        # The scratch block lies past the pool's view: index into the full storage through a view
        # that includes it (the caches are slices of a larger tensor).
        caches = [(k.as_strided((k.shape[0] + block_size, *k.shape[1:]), k.stride()),
                   v.as_strided((v.shape[0] + block_size, *v.shape[1:]), v.stride())) for k, v in kv_caches]
        max_model_len = self.config.max_model_len or self.model_config.max_position_embeddings
        self.graphs = DecodeGraphs(model, caches, block_size, -(-max_model_len // block_size),
                                   decode_buckets(self.config.max_num_seqs), self.num_slots, self.device, layer_group)
        self.max_decode_rows = self.graphs.buckets[-1]

    @property
    def has_warm_up(self) -> bool:
        return self.graphs is not None

    def warm_up(self) -> None:
        """Capture the decode graphs (bound by bind_kv_cache): seconds, before the first request."""
        self.graphs.capture()

    def decode_logits(self, token_ids: list[int], block_tables: list[list[list[int]]], context_lens: list[int],
                      with_argmax: bool) -> tuple[torch.Tensor, list[int] | None]:
        return self.graphs.step(token_ids, block_tables, context_lens, with_argmax)

    def describe(self) -> str:
        graphs = f"decode graphs for batch {self.graphs.buckets}" if self.graphs else "eager"
        return f"{super().describe()}, Triton attention, {graphs}"
