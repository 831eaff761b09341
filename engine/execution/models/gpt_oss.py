"""gpt-oss (`gpt_oss`): the Llama decoder with OpenAI's choices, as ModelConfig fields.

- attention with biases on q/k/v and o, and a learned sink logit per query head in every
  softmax's denominator (ModelConfig.attn_sinks; engine/execution/attention.py);
- sliding-window (128) and full layers alternating by the config's `layer_types`;
- YaRN RoPE (transformers' own init gives its frequencies and attention factor);
- every layer's MLP sparse (models/moe.py): a router with a bias, top-k then softmax over the k,
  experts with biases and the clamped SwiGLU.

Checkpoint layout (transformers' GptOssExperts): `mlp.experts.gate_up_proj` [E, H, 2I] with each
expert's gate and up columns interleaved (gate = [..., ::2], up = [..., 1::2]), its bias
[E, 2I] likewise, `down_proj` [E, I, H]. Loading names each expert's tensors apart, as
Qwen3-MoE's and llama.cpp's do (mlp.experts.N.gate_proj.weight [I, H], up_proj, down_proj
[H, I] and their biases): transformers' stacked tensors are split into them (their columns
de-interleaved, transposed) and a GGUF file's stacked experts (ffn_gate_exps ..., gate and up
already apart) by the GGUF loader, which keeps their blocks; both fill the stacked experts'
[E, 2I, H] (gate rows first) and [E, H, I] by shards.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from engine.execution.models.llama import LlamaForCausalLM
from engine.execution.models.model_config import ModelConfig
from engine.execution.models.moe import MoeConfig, per_expert_names

_EXPERTS = "mlp.experts."
# transformers' stacked experts' tensors (after mlp.experts.), each split by expert
_STACKED = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def moe_config_from_hf(hf: Any) -> MoeConfig:
    return MoeConfig(num_experts=hf.num_local_experts, num_experts_per_tok=hf.num_experts_per_tok,
                     intermediate_size=hf.intermediate_size, routing="topk_softmax", activation="swiglu_oai",
                     router_bias=True, expert_bias=True, swiglu_alpha=float(getattr(hf, "swiglu_alpha", 1.702)),
                     swiglu_limit=float(getattr(hf, "swiglu_limit", 7.0)))


class GptOssForCausalLM(LlamaForCausalLM):
    #: transformers' sinks are a bare parameter of its attention module; ours sit on the layer
    PART_NAMES = {"sinks": "self_attn.sinks"}

    @classmethod
    def config_from_hf(cls, hf: Any) -> ModelConfig:
        bias = bool(getattr(hf, "attention_bias", True))
        return ModelConfig.from_hf(hf, qkv_bias=bias, o_proj_bias=bias, attn_sinks=True, moe=moe_config_from_hf(hf),
                                   moe_layers=(True,) * hf.num_hidden_layers)

    def _moe_weights(self, name: str, layer: int) -> dict[str, str]:
        prefix = f"model.layers.{layer}.mlp"
        part = name.split(".", 3)[3]  # router.weight / .bias, experts.gate_up / .down / .gate_up_bias / .down_bias
        if part.startswith("router."):
            return {name: f"{prefix}.{part}"}
        return per_expert_names(name, f"{prefix}.experts", self.config.moe.num_experts)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_per_expert(weights))


def _per_expert(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers' stacked experts split into each expert's tensors (module docstring); views, no copies."""
    for name, tensor in weights:
        prefix, experts, rest = name.partition(_EXPERTS)
        if not experts or rest not in _STACKED:
            yield name, tensor
            continue
        prefix += _EXPERTS
        for e in range(tensor.shape[0]):
            if rest == "gate_up_proj":  # [H, 2I], gate and up columns alternating -> [I, H] each
                yield f"{prefix}{e}.gate_proj.weight", tensor[e, :, ::2].T
                yield f"{prefix}{e}.up_proj.weight", tensor[e, :, 1::2].T
            elif rest == "gate_up_proj_bias":
                yield f"{prefix}{e}.gate_proj.bias", tensor[e, ::2]
                yield f"{prefix}{e}.up_proj.bias", tensor[e, 1::2]
            elif rest == "down_proj":  # [I, H] -> [H, I]
                yield f"{prefix}{e}.down_proj.weight", tensor[e].T
            else:
                yield f"{prefix}{e}.down_proj.bias", tensor[e]
