"""The CPU backend's fused path: each decoder layer as one or two C++ calls over the panel-packed
weights, for steps of a few tokens, and a decode-only step as a single call from token ids to
logits (kernels.DecodeModel).

Why: a small step through torch's modules dispatches about 150 ops per layer, which alone take
about as long as the step's weight stream; here a step costs its GEMM rows. A decode-only step
is one call; a step with prefill rows is two per layer, around the step's attention (a chunk's
queries share every key they read; per-row decode attention would walk the context once per
query). The model describes the layers; this module binds them to the kernels.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from engine.execution.attention import AttentionMetadata, attention
from engine.execution.backends.cpu_gguf import kernel_args

# ModelConfig.hidden_act -> the kernels' Activation (cpu_kernels.h).
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
# MoeConfig.routing -> the kernels' Routing (cpu_kernels.h).
ROUTINGS = {"softmax_topk": 0, "topk_softmax": 1}


def _norm_weight(norm: nn.Module | None) -> torch.Tensor | None:
    """A norm's weight as the kernels take it ([width] float32), None for a norm the layer lacks."""
    return None if norm is None else norm.weight.float().contiguous()


@dataclass(slots=True)
class FusedLayer:
    """One decoder layer as the C++ calls take it: its float32 norm weights and four projections'
    panels, bound once as kernels.DecodeLayerWeights, and the shapes the calls need."""

    weights: Any  # kernels.DecodeLayerWeights
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int  # 0: none
    eps: float
    scale: float
    act: int  # ACTIVATIONS' value
    rope_index: int
    sinks: torch.Tensor | None  # [num_heads] float32: gpt-oss's sink logits, in the attention's denominators

    @classmethod
    def of(cls, layer: nn.Module, kernels: ModuleType) -> FusedLayer:
        """`layer` (a DecoderLayer) once its projections hold panels: its norms (the per-head
        q/k norms and the output norms where the family has them) and its products; a sparse
        layer's router panels and experts op (PackedExperts: pack_moe_experts ran first) in place
        of gate_up and down; gpt-oss's sinks in its attention."""
        moe = layer.moe
        absent = (torch.empty(0, dtype=torch.uint8), None, None, 0)  # out_features 0: the MoeMlp has the experts
        mlp = ((absent, absent) if moe is not None else
               (kernel_args(layer.gate_up_proj.panels), kernel_args(layer.down_proj.panels)))
        window = layer.sliding_window or 0
        weights = kernels.DecodeLayerWeights(
            _norm_weight(layer.input_layernorm), _norm_weight(layer.post_attention_layernorm),
            kernel_args(layer.qkv_proj.panels), kernel_args(layer.o_proj.panels), *mlp, window,
            _norm_weight(layer.q_norm), _norm_weight(layer.k_norm), _norm_weight(layer.attn_output_norm),
            _norm_weight(layer.mlp_output_norm), layer.rope_index)
        if moe is not None:
            weights.moe = kernels.MoeMlp(kernel_args(moe.router.panels), moe.experts.op, moe.cfg.num_experts_per_tok,
                                         ROUTINGS[moe.cfg.routing], moe.cfg.norm_topk_prob)
        sinks = None if layer.sinks is None else layer.sinks.detach().float().contiguous()
        weights.sinks = sinks
        return cls(weights, layer.num_heads, layer.num_kv_heads, layer.head_dim, window, layer.eps, layer.scale,
                   ACTIVATIONS[layer.hidden_act], layer.rope_index, sinks)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor, kernels: ModuleType, isa: int,
                rows: torch.Tensor | None = None) -> None:
        """x: [T, hidden] float32, updated in place; cos, sin: [T, head_dim] float32 (this layer's rope).
        rows ([R] int64): only those rows of x updated past attention (every row's K and V are
        written and attended to); the others keep the layer's input."""
        if attn.num_prefill_tokens == 0:
            kernels.decode_layer(x, cos, sin, self.weights, k_cache, v_cache, attn.slot_mapping, attn.block_tables,
                                 attn.context_lens, self.num_heads, attn.block_size, self.eps, self.scale, self.act,
                                 isa)
            return
        num_tokens = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv_out = kernels.layer_attention_inputs(x, cos, sin, self.weights, k_cache, v_cache, attn.slot_mapping,
                                                 self.num_heads, self.eps, isa)  # [T, q | k | v]
        q, k, v = qkv_out.split((q_size, kv_size, kv_size), dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = attention(q, k, v, k_cache, v_cache, attn, self.scale, self.window or None, self.sinks)  # [T, H, D] float32
        out = out.reshape(num_tokens, q_size)
        if rows is None:
            kernels.layer_attention_outputs(x, out, self.weights, self.eps, self.act, isa)
            return
        if rows.numel() == 0:  # a chunk that samples nothing: its keys and values were all it had to give
            return
        x_rows = x[rows]  # [R, hidden]
        kernels.layer_attention_outputs(x_rows, out[rows], self.weights, self.eps, self.act, isa)
        x.index_copy_(0, rows, x_rows)


class FusedModel:
    """A Llama-family model bound to the C++ kernels: its fused layers, and (bind_decode) the
    decode-only step as one call."""

    def __init__(self, model: nn.Module, kernels: ModuleType, isa: int) -> None:
        self.model, self.kernels, self.isa = model, kernels, isa
        self.layers = [FusedLayer.of(layer, kernels) for layer in model.layers]
        self.sparse = [layer.moe for layer in model.layers if layer.moe is not None]  # SparseMoe modules
        self.final_norm = model.norm.weight.float().contiguous()  # [hidden] float32
        self.num_ropes = len(model.config.ropes)
        self.decoder: Any = None  # kernels.DecodeModel, once bind_decode has the caches

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden: [T, hidden]; the residual stream stays float32
        across layers. output_rows ([R] int64): the only rows of hidden anyone reads; the last
        layer's products past attention run for them alone (a 512-token chunk that samples one
        token: one row, not 512), the other rows left with the layer before's states."""
        x = self.model.embed(input_ids)  # scaled in its dtype where the family scales it
        dtype = x.dtype
        x = x.float().contiguous()
        ropes = [self.model.rope(positions, i) for i in range(self.num_ropes)]  # cos, sin: [T, head_dim] each
        last = len(self.layers) - 1
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            cos, sin = ropes[layer.rope_index]
            layer.forward(x, cos, sin, attn.for_layer(i), k_cache, v_cache, self.kernels, self.isa,
                          output_rows if i == last else None)
        self._count_experts()
        return self.model.norm(x).to(dtype)

    def _count_experts(self) -> None:
        """The step's count of experts run: an int each op kept from its grouping (the per-layer
        call's, or the one-call step's, which sets it)."""
        for moe in self.sparse:
            if moe.usage is not None:
                moe.usage.add(moe.experts.op.last_num_routed)

    def bind_decode(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                    layer_group: tuple[int, ...]) -> None:
        """Bind what every decode-only step shares: the weights, the RoPE tables, the caches and
        each layer's KV-cache group, not converted from Python on every call."""
        model = self.model
        tables = [model.rope_tables_on(self.final_norm.device, i) for i in range(self.num_ropes)]
        first = self.layers[0]  # the layers share heads, eps, scale and activation (and the final norm's eps)
        embedding = getattr(model.embed_tokens, "data", None)  # the LM head's panels, when it holds the embedding
        embed_scale = None
        if model.config.embed_scale is not None:  # in the dtype torch's lookup returns, as model.embed multiplies
            dtype = model.embed_tokens(torch.zeros(1, dtype=torch.long)).dtype
            embed_scale = torch.tensor(model.config.embed_scale, dtype=dtype)
        self.decoder = self.kernels.DecodeModel(
            embedding if embedding is not None else model.embed_tokens.weight, [cos for cos, _ in tables],
            [sin for _, sin in tables], [layer.weights for layer in self.layers], kv_caches, self.final_norm,
            kernel_args(model.lm_head.panels), first.num_heads, block_size, first.eps, first.scale, first.act,
            embed_scale, self.isa, list(layer_group))

    def decode_logits(self, token_ids: list[int], block_tables: list[list[list[int]]], context_lens: list[int],
                      with_argmax: bool = False) -> tuple[torch.Tensor, list[int] | None]:
        """A decode-only step in one C++ call: per sequence its last token, its block table in each
        KV-cache group (block_tables[group][row]) and its context length (the token's position + 1)
        -> logits [B, vocab] float32 and, with_argmax, each row's first argmax (torch.argmax's
        rule) as a list, else None. One call, not a dozen
        torch and numpy ops: after a batch-1 step's weight stream every such op finds the caches cold."""
        out = self.decoder.step(token_ids, block_tables, context_lens, with_argmax)
        if self.sparse:
            self._count_experts()
        return out

    def take_part_seconds(self) -> dict[str, float] | None:
        """The fused decode steps' wall seconds by kind of part (qkv, attention, o_proj, gate_up,
        silu, down, lm_head, argmax, outside) and their count ('steps'), summed since the last
        call, which this zeroes; None before bind_decode."""
        return None if self.decoder is None else dict(self.decoder.take_part_seconds())
