"""Qwen3-MoE: Qwen3's attention (per-head query / key norms, head_dim from the config) with a
sparse mixture-of-experts MLP in most layers: a softmax router over all experts, the top k,
renormalised over the k where `norm_topk_prob` is set, SwiGLU experts of `moe_intermediate_size`.

Which layers are sparse is decided as transformers' Qwen3MoeDecoderLayer decides it: layer i is
sparse unless i is in `mlp_only_layers`, and only if num_experts > 0 and (i + 1) is a multiple of
`decoder_sparse_step`; the others keep a dense MLP of `intermediate_size`.

`norm_topk_prob` is read from the checkpoint's config: transformers' class defaults it to false,
the released checkpoints (Qwen3-30B-A3B, Qwen3-235B-A22B) set it true.

Checkpoint names: transformers' save_pretrained and the hub write each expert's projections
(mlp.experts.N.gate_proj.weight, up_proj, down_proj) and the router as mlp.gate.weight; a
state_dict of transformers' own model (what a GGUF file converted by transformers holds) has the
experts fused, mlp.experts.gate_up_proj [E, 2I, H] and mlp.experts.down_proj [E, H, I]. Both load.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from engine.execution.models.llama import LlamaForCausalLM
from engine.execution.models.model_config import ModelConfig
from engine.execution.models.moe import MoeConfig, per_expert_names

_FUSED_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(\.weight)?$")


def moe_layers(hf: Any) -> tuple[bool, ...]:
    """Per layer, whether its MLP is the sparse one (Qwen3MoeDecoderLayer's rule)."""
    mlp_only = set(getattr(hf, "mlp_only_layers", None) or ())
    step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
    num_experts = int(getattr(hf, "num_experts", 0) or 0)
    return tuple(i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 for i in range(hf.num_hidden_layers))


def _per_expert(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, a fused experts tensor split into each expert's projections."""
    for name, tensor in weights:
        match = _FUSED_EXPERTS.match(name)
        if match is None or tensor.dim() != 3:
            yield name, tensor
            continue
        prefix, kind = match.group(1), match.group(2)
        for expert in range(tensor.shape[0]):
            if kind == "down_proj":
                yield f"{prefix}.{expert}.down_proj.weight", tensor[expert]
            else:
                gate, up = tensor[expert].chunk(2, dim=0)
                yield f"{prefix}.{expert}.gate_proj.weight", gate
                yield f"{prefix}.{expert}.up_proj.weight", up


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    @classmethod
    def config_from_hf(cls, hf: Any) -> ModelConfig:
        moe = MoeConfig(num_experts=int(hf.num_experts), num_experts_per_tok=int(hf.num_experts_per_tok),
                        intermediate_size=int(hf.moe_intermediate_size),
                        norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)))
        attention_bias = bool(getattr(hf, "attention_bias", False))
        return ModelConfig.from_hf(hf, qkv_bias=attention_bias, o_proj_bias=attention_bias, qk_norm=True, moe=moe,
                                   moe_layers=moe_layers(hf))

    def _moe_weights(self, name: str, layer: int) -> dict[str, str]:
        prefix = f"model.layers.{layer}.mlp"
        part = name.split(".", 3)[3]  # router.weight, experts.gate_up or experts.down
        if part == "router.weight":
            return {name: f"{prefix}.gate.weight"}
        if part in ("experts.gate_up", "experts.down"):
            return per_expert_names(name, f"{prefix}.experts", self.config.moe.num_experts)
        raise ValueError(f"model: Qwen3-MoE has no parameter {name!r}")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_per_expert(weights))
