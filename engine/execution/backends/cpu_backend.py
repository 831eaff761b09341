"""The CPU backend: the C++ kernels (panel GEMMs, fused layers, paged attention) with their SIMD
path chosen at run time, oneDNN-packed weights for the steps the panels do not run, and the KV
pool and weight panels on 2 MiB pages. Without the kernels (no compiler, enable_cpp_kernels
off) it runs torch's attention over oneDNN-packed weights.
"""
from __future__ import annotations

import logging
import sys

import torch
from torch import nn

from engine.config import Quantization
from engine.execution.attention import AttentionMetadata
from engine.execution.backends.backend import Backend
from engine.execution.backends.cpu_attention import CpuAttention
from engine.execution.backends.cpu_fused import FusedModel
from engine.execution.backends.cpu_gguf import embedding_of, pack_gguf_linears
from engine.execution.backends.cpu_linear import PanelEmbedding, can_pack_linear, pack_linears
from engine.execution.backends.cpu_moe import pack_moe_experts
from engine.execution.heap_policy import release_free_memory
from engine.execution.huge_pages import huge_page_tensor
from engine.execution.kernels import ISAS
from engine.execution.models.meta_model import meta_model
from engine.execution.models.model_config import ModelConfig
from engine.execution.resolved_config import ResolvedConfig
from engine.execution.weights.gguf_file import GGUFFile
from engine.execution.weights.gguf_loader import load_gguf_weights
from engine.execution.weights.packed_weight import place_on_huge_pages

logger = logging.getLogger(__name__)


def default_max_fused_tokens(dtype: torch.dtype, isa: int, quantized: bool) -> int:
    """Steps of up to this many tokens run the fused layers, by the crossovers measured against
    oneDNN (docs/benchmarks.md): every step in int8 (the panels are its only copy), in float32
    with AVX-512 and in bfloat16 with vdpbf16ps or AMX; else 64 tokens in float32 and 8 in
    bfloat16 (bf16 on the FMA units loses to oneDNN past a few rows)."""
    every_step = quantized or (dtype == torch.float32 and isa >= ISAS["avx512"]) or isa >= ISAS["avx512_bf16"]
    return sys.maxsize if every_step else 64 if dtype == torch.float32 else 8


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self, resolved: ResolvedConfig, model_config: ModelConfig) -> None:
        super().__init__(resolved, model_config, resolved.device, resolved.dtype)
        dtype, config = resolved.dtype, resolved.config
        self.quantized = resolved.quantization is Quantization.INT8
        # the GGUF file's blocks, by the integer-dot kernels (resolve_config gave both only with kernels)
        self.gguf = resolved.quantization is Quantization.GGUF
        self.kernels = kernels = resolved.kernels
        self.isa = resolved.isa
        max_fused = config.max_fused_tokens
        if max_fused is None:
            max_fused = default_max_fused_tokens(dtype, self.isa, self.quantized or self.gguf)
        if model_config.attn_sinks and self.quantized:  # gpt-oss
            raise ValueError(f"quantization: int8 is not tested on {model_config.model_type} (attention sinks); "
                             "use quantization none")
        self.panel_dtype = torch.int8 if self.quantized else dtype if kernels is not None and max_fused > 0 else None
        # Steps of up to max_panel_rows rows multiply on the panels (the fused layers, or each
        # PackedLinear alone where there are none).
        self.max_panel_rows = max_fused if self.panel_dtype is not None else 0
        # The fused layers and the one-call decode step know causal decoders, their MLPs dense or
        # sparse (the router, routing and the MoeExperts op's products), gpt-oss's attention sinks
        # in their attention. An encoder (BERT: bidirectional, no KV cache) runs every step through
        # its modules, its projections still on the panels.
        self.is_encoder = not model_config.is_causal
        self.can_fuse = not self.is_encoder
        if not self.can_fuse:
            logger.info("an encoder: the CPU backend runs every step through the model's modules (panel or oneDNN "
                        "projections), not its fused layers")
        self.max_fused_tokens = self.max_panel_rows if self.can_fuse else 0
        self.max_decode_rows = self.max_fused_tokens
        # oneDNN's copy of the weights only where some step runs the torch path.
        is_every_step_fused = self.panel_dtype is not None and max_fused == sys.maxsize
        self.onednn = not is_every_step_fused and config.enable_onednn and can_pack_linear(dtype)
        self.fused: FusedModel | None = None
        if kernels is not None:
            mc = model_config
            # The C++ prefill attention where it was measured ahead of torch's flash kernel: its AVX-512 tiles.
            fits = mc.num_heads // mc.num_kv_heads <= 8 and mc.head_dim <= 256
            self.attention = CpuAttention(kernels, self.isa, prefill_in_cpp=self.isa >= ISAS["avx512"] and fits,
                                          is_bfloat16=dtype == torch.bfloat16)

    def load_gguf_model(self, model_class: type[nn.Module], gguf: GGUFFile) -> nn.Module:
        model = meta_model(model_class, self.model_config)  # the file's tensors replace every parameter
        return load_gguf_weights(model, gguf).to(dtype=self.dtype)

    def prepare(self, model: nn.Module) -> None:
        if self.gguf:
            self._prepare_gguf(model)
        elif self.onednn or self.panel_dtype is not None:
            packed = pack_linears(model, self.onednn, self.panel_dtype, self.kernels, self.isa, self.max_panel_rows,
                                  keep=(model.embed_tokens,))
            if self.is_encoder and self.panel_dtype == torch.bfloat16 and not self.onednn \
                    and self.isa >= ISAS["avx512_bf16"]:
                # Every product runs on the bfloat16 panels by vdpbf16ps or AMX, which take
                # float32 rows (rounded to bfloat16 as they are read): the rest of the encoder
                # (LayerNorms, the residual stream, attention's inputs) stays float32, as the
                # decoders' fused layers keep theirs. A bfloat16 stream cost a rounding copy after
                # each product and bfloat16 GELU / LayerNorm passes (a fifth of a bge-small step),
                # and kept the products' bias + GELU and residual add + LayerNorm out of them. The
                # word embedding stays bfloat16 (a 250k-row table would double): its rows join
                # the float32 position embeddings as float32, the same values.
                for name, param in model.named_parameters():
                    if not name.startswith("embed_tokens."):
                        param.data = param.data.float()
            if self.panel_dtype is not None:
                if self.config.enable_huge_pages:  # before the fused layers take the panels' addresses
                    place_on_huge_pages([m.panels for m in packed])
                pack_moe_experts(model, self.panel_dtype, self.kernels, self.isa, self.config.enable_huge_pages)
                if model.config.tie_word_embeddings and self.panel_dtype in (torch.float32, torch.bfloat16):
                    # The LM head's panels hold the embedding's very values: the matrix is kept once.
                    # (int8 panels would round the embedding, so int8 keeps it.)
                    model.embed_tokens = PanelEmbedding(model.lm_head, self.dtype)
                    model.lm_head.drop_weight()
                if self.can_fuse:  # after pack_moe_experts: a sparse layer's call takes its experts' op
                    self.fused = FusedModel(model, self.kernels, self.isa)
        release_free_memory()  # the plain weights the packing replaced

    def _prepare_gguf(self, model: nn.Module) -> None:
        """The GGUF blocks into the integer-dot kernels' panels, and the fused layers over them."""
        packed = pack_gguf_linears(model, self.dtype, self.kernels, self.isa)
        if self.config.enable_huge_pages:  # before the fused layers take the panels' addresses
            place_on_huge_pages([m.panels for m in packed])
        pack_moe_experts(model, self.dtype, self.kernels, self.isa, self.config.enable_huge_pages)
        model.embed_tokens = embedding_of(model, self.dtype, self.kernels)
        if self.can_fuse:
            self.fused = FusedModel(model, self.kernels, self.isa)

    def allocate_kv_cache(self, shape: tuple[int, ...]) -> torch.Tensor:
        if not self.config.enable_huge_pages:
            return super().allocate_kv_cache(shape)
        # Faulted in now, not by the steps that first write each block: a fault there (a 2 MiB
        # page zeroed, perhaps compacted for) made prefill steps look slow to the step cost
        # model, which then cut chunks small.
        return huge_page_tensor(shape, self.cache_dtype).zero_()

    def bind_kv_cache(self, model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      block_size: int, layer_group: tuple[int, ...]) -> None:
        if self.fused is not None and self.max_decode_rows > 0:
            self.fused.bind_decode(kv_caches, block_size, layer_group)

    def forward(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], **model_inputs: torch.Tensor | None) -> torch.Tensor:
        # The fused layers are the Llama family's: no inputs but the rows read after the step
        if attn.is_fused and model_inputs.keys() <= {"output_rows"}:
            return self.fused.forward(input_ids, positions, attn, kv_caches, model_inputs.get("output_rows"))
        return model(input_ids, positions, attn, kv_caches, **model_inputs)

    def decode_logits(self, token_ids: list[int], block_tables: list[list[list[int]]], context_lens: list[int],
                      with_argmax: bool) -> tuple[torch.Tensor, list[int] | None]:
        return self.fused.decode_logits(token_ids, block_tables, context_lens, with_argmax)

    def release_idle_memory(self) -> None:
        if self.kernels is not None:
            self.kernels.release_scratch()  # the large step buffers kept between steps
        super().release_idle_memory()

    def describe(self) -> str:
        isa = next(name for name, value in ISAS.items() if value == self.isa) if self.kernels else "no C++ kernels"
        fused = ("no fused steps (encoder)" if not self.can_fuse else "every step fused"
                 if self.max_fused_tokens == sys.maxsize else f"fused steps up to {self.max_fused_tokens} tokens")
        return f"{super().describe()}, {isa}, {fused}"
