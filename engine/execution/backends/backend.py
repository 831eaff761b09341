"""The seam below the runner: what differs between devices and kernel sets.

A Backend holds the device and dtypes, loads the model's weights into the form it runs, makes
the KV cache pool, runs a step's forward (and, where it has one, a dedicated decode-only path)
and names the AttentionBackend the model's layers call. The runner above it is the same for
every backend: persistent batch, step inputs, sampling. This base class is the pure-torch
reference (F.linear, SDPA, gathered decode attention) on any device; the CPU backend
(cpu_backend.py) and the CUDA backend (cuda_backend.py) specialise it.
"""
from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.execution.attention import AttentionBackend, AttentionMetadata
from engine.execution.backends.torch_attention import TorchAttention
from engine.execution.heap_policy import release_free_memory
from engine.execution.models.model_config import ModelConfig
from engine.execution.resolved_config import ResolvedConfig

if TYPE_CHECKING:
    from engine.execution.weights.gguf_file import GGUFFile


class Backend:
    name = "torch"

    def __init__(self, resolved: ResolvedConfig, model_config: ModelConfig, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.resolved, self.config, self.model_config = resolved, resolved.config, model_config
        self.device, self.dtype = device, dtype
        self.cache_dtype = resolved.kv_cache_dtype
        self.attention: AttentionBackend = TorchAttention()
        self.kernels: ModuleType | None = None  # the C++ CPU kernels, where this backend has them
        self.max_fused_tokens = 0  # steps of at most this many tokens take the backend's fused layers
        self.max_decode_rows = 0  # decode-only steps of at most this many rows take decode_logits
        self.gguf = False  # quantization gguf: the model keeps the file's blocks (load_gguf_model)
        if device.type == "cpu":
            torch.set_num_threads(resolved.num_threads)

    def load_model(self, model_class: type[nn.Module], weights: Iterable[tuple[str, torch.Tensor]]) -> nn.Module:
        """The model built on the device (its initial values are overwritten: on a GPU that init
        takes a moment, not a CPU's minutes for a billion parameters), its weights loaded in
        this backend's dtype; prepare() then puts them in the form it runs."""
        with torch.device(self.device):
            model = model_class(self.model_config)
        model.load_weights(weights)
        return model.to(device=self.device, dtype=self.dtype).eval()

    def load_gguf_model(self, model_class: type[nn.Module], gguf: GGUFFile) -> nn.Module:
        """The model with a GGUF file's quantized blocks kept as they are (quantization gguf),
        for prepare(). resolve_config gives quantization gguf to the CPU backend only: no user
        reaches this."""
        raise NotImplementedError(f"the {self.name} backend runs no GGUF blocks")

    def prepare(self, model: nn.Module) -> None:
        """Pack or bind the loaded model's weights (nothing for the reference): apart from
        loading, so a start can time the two."""

    @property
    def has_warm_up(self) -> bool:
        """Whether warm_up() does anything (it is a start-up phase of its own)."""
        return False

    def warm_up(self) -> None:
        """Once the KV pool is bound: pay now what the first steps would (CUDA graph capture)."""

    def kv_cache_bytes(self) -> int:
        """The KV pool's size when num_kv_blocks is unset: kv_cache_gib."""
        return int(self.config.kv_cache_gib * 2**30)

    def allocate_kv_cache(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The pool: [layers, k/v, slots, kv_heads, head_dim] in the cache's dtype, zeroed."""
        return torch.zeros(shape, dtype=self.cache_dtype, device=self.device)

    def bind_kv_cache(self, model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      block_size: int, layer_group: tuple[int, ...]) -> None:
        """Called once the pool exists (a backend may bind its decode path to it); layer_group:
        each layer's KV-cache group, whose block tables it reads."""

    def forward(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], **model_inputs: torch.Tensor | None) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden: [T, hidden]. model_inputs: what a model reads beyond
        them, as keywords of its forward (token_type_ids [T] for a model with uses_token_types)."""
        return model(input_ids, positions, attn, kv_caches, **model_inputs)

    def decode_logits(self, token_ids: list[int], block_tables: list[list[list[int]]], context_lens: list[int],
                      with_argmax: bool) -> tuple[torch.Tensor, list[int] | None]:
        """A decode-only step of at most max_decode_rows rows (block_tables: [groups][rows], each
        row's table in each KV-cache group) by the backend's own path -> logits
        [B, vocab] float32 and, with_argmax, each row's first argmax (else None)."""
        raise NotImplementedError(f"the {self.name} backend has no dedicated decode path")

    @torch.inference_mode()
    def copy_blocks(self, kv_cache: torch.Tensor, pairs: list[tuple[int, int]], block_size: int) -> None:
        """Copy-on-write: the K/V of block src into block dst, every layer at once."""
        offsets = torch.arange(block_size)
        src = torch.cat([offsets + s * block_size for s, _ in pairs]).to(self.device)  # [copies * bs] slots
        dst = torch.cat([offsets + d * block_size for _, d in pairs]).to(self.device)
        kv_cache[:, :, dst] = kv_cache[:, :, src]  # [layers, k/v, slots, kv_heads, head_dim]

    def release_idle_memory(self) -> None:
        """The engine has fallen idle: hand back what the steps kept for the next one (the C
        heap's free pages; a backend's own scratch too)."""
        release_free_memory()

    def describe(self) -> str:
        return f"{self.name} backend on {self.device} ({self.dtype}, KV cache {self.cache_dtype})"
