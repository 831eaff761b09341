"""Attention by the C++ CPU kernels (engine/execution/kernels): the paged decode kernel walks
each block table directly; the prefill kernel (flash-style tiles reading every key from the
paged cache through the block table) runs where it was measured ahead of torch's flash kernel,
on AVX-512; its portable loop is slower than flash, so AVX2 CPUs keep torch's prefill
(docs/benchmarks.md has the figures)."""
from __future__ import annotations

from types import ModuleType

import torch

from engine.execution.attention import AttentionMetadata
from engine.execution.backends.torch_attention import TorchAttention
from engine.execution.kernels import ISAS


class CpuAttention(TorchAttention):
    def __init__(self, kernels: ModuleType, isa: int, prefill_in_cpp: bool, is_bfloat16: bool = False) -> None:
        self.kernels, self.isa = kernels, isa
        self.prefill_in_cpp = prefill_in_cpp
        self.reads_prefill_block_tables = prefill_in_cpp
        # The encoders' kernel runs the prefill kernel's AVX-512 tiles (its portable loop loses to torch).
        self.has_bidirectional_kernel = prefill_in_cpp
        # A bfloat16 model's encoder attention multiplies in bfloat16 where vdpbf16ps runs, as a
        # bfloat16 cache's prefill does (a float32 model's stays float32: exact).
        self.is_bf16_bidirectional = is_bfloat16 and isa >= ISAS["avx512_bf16"]

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, attn: AttentionMetadata, scale: float, window: int | None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        if not self.prefill_in_cpp:
            return super().prefill(q, k, v, k_cache, v_cache, attn, scale, window, sinks)
        sinks32 = None if sinks is None else sinks.float().contiguous()  # [H]
        # q: [T, H, D] -> [T, H, D]. The kernel reads q's rows where they are (a strided slice of the
        # fused QKV output) and writes each chunk's rows into the step's output: no copy of either.
        q32 = q.float()
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        for meta in attn.prefill:
            rows = slice(meta.query_start, meta.query_start + meta.query_len)
            self.kernels.paged_prefill_attention(q32[rows], k_cache, v_cache, meta.block_table, meta.num_cached_tokens,
                                                 attn.block_size, scale, window or 0, self.isa, out[rows], sinks32)
        return out.to(q.dtype)

    def bidirectional(self, qkv: torch.Tensor, query_starts: torch.Tensor, num_heads: int,
                      scale: float) -> torch.Tensor:
        # Each prompt's q, k and v read in place from the fused projection's rows: no padded batch.
        # The output in qkv's dtype: a bfloat16 qkv (a bfloat16 stream's, or forward_rounded's on
        # AMX beside a float32 stream) gets bfloat16 rows, which the o projection would round to anyway.
        num_tokens, head_dim = qkv.shape[0], qkv.shape[1] // (3 * num_heads)
        bf16_products = self.is_bf16_bidirectional and head_dim % 16 == 0
        # bfloat16 qkv (forward_rounded's) goes in as it is where the products are bfloat16 anyway,
        # and its rows come out rounded by the kernel (prompt by prompt where prompts run whole on a
        # thread, else in a pass after them)
        is_bf16_in = bf16_products and qkv.dtype == torch.bfloat16
        qkv_in = qkv.contiguous() if is_bf16_in else qkv.float().contiguous()
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.bfloat16 if is_bf16_in else torch.float32)
        self.kernels.packed_bidirectional_attention(qkv_in, query_starts, num_heads, scale, self.isa, out, bf16_products)
        return out.to(qkv.dtype)

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionMetadata,
               scale: float, window: int | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        # q: [B, H, D]; sinks: [H] or None -> out: [B, H, D] in q's dtype (the fused layers' q is float32 over any cache)
        sinks32 = None if sinks is None else sinks.float().contiguous()
        return self.kernels.paged_decode_attention(q.to(k_cache.dtype), k_cache, v_cache, attn.block_tables,
                                                   attn.context_lens, attn.block_size, scale, window or 0,
                                                   self.isa, sinks32).to(q.dtype)

    def prepare_decode(self, attn: AttentionMetadata, block_tables: torch.Tensor, context_lens: torch.Tensor) -> None:
        attn.block_tables, attn.context_lens = block_tables, context_lens  # the kernel walks the tables itself
