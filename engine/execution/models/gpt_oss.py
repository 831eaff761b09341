"""gpt-oss (`gpt_oss`): the Llama decoder with OpenAI's choices, as ModelConfig fields.

- attention with biases on q/k/v and o, and a learned sink logit per query head in every
  softmax's denominator (ModelConfig.attn_sinks; engine/execution/attention.py);
- sliding-window (128) and full layers alternating by the config's `layer_types`;
- YaRN RoPE (transformers' own init gives its frequencies and attention factor);
- every layer's MLP sparse (models/moe.py): a router with a bias, top-k then softmax over the k,
  experts with biases and the clamped SwiGLU.

Checkpoint layout (transformers' GptOssExperts): `mlp.experts.gate_up_proj` [E, H, 2I] with each
expert's gate and up columns interleaved (gate = [..., ::2], up = [..., 1::2]), its bias
[E, 2I] likewise, `down_proj` [E, I, H]; loading transposes them to the stacked experts'
[E, 2I, H] (gate rows first) and [E, H, I].
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from engine.execution.models.llama import LlamaForCausalLM
from engine.execution.models.model_config import ModelConfig
from engine.execution.models.moe import MoeConfig

# A checkpoint's sparse-MLP tensor (after `model.layers.{i}.mlp.`) -> ours (after `model.layers.{i}.moe.`).
_MOE_NAMES = {"router.weight": "router.weight", "router.bias": "router.bias",
              "experts.gate_up_proj": "experts.gate_up", "experts.gate_up_proj_bias": "experts.gate_up_bias",
              "experts.down_proj": "experts.down", "experts.down_proj_bias": "experts.down_bias"}


def moe_config_from_hf(hf: Any) -> MoeConfig:
    return MoeConfig(num_experts=hf.num_local_experts, num_experts_per_tok=hf.num_experts_per_tok,
                     intermediate_size=hf.intermediate_size, routing="topk_softmax", activation="swiglu_oai",
                     router_bias=True, expert_bias=True, swiglu_alpha=float(getattr(hf, "swiglu_alpha", 1.702)),
                     swiglu_limit=float(getattr(hf, "swiglu_limit", 7.0)))


def deinterleave(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] with gate and up alternating -> [..., 2I] with the I gate values first."""
    return torch.cat((gate_up[..., ::2], gate_up[..., 1::2]), dim=-1)


class GptOssForCausalLM(LlamaForCausalLM):
    @classmethod
    def config_from_hf(cls, hf: Any) -> ModelConfig:
        bias = bool(getattr(hf, "attention_bias", True))
        return ModelConfig.from_hf(hf, qkv_bias=bias, o_proj_bias=bias, attn_sinks=True, moe=moe_config_from_hf(hf),
                                   moe_layers=(True,) * hf.num_hidden_layers)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._our_layout(weights))

    @staticmethod
    def _our_layout(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """transformers' names and expert layout -> the stacked experts' (module docstring)."""
        for name, tensor in weights:
            prefix, mlp, rest = name.partition(".mlp.")
            if not mlp or rest not in _MOE_NAMES:
                yield name.replace(".self_attn.sinks", ".sinks"), tensor
                continue
            if rest == "experts.gate_up_proj":  # [E, H, 2I] interleaved -> [E, 2I, H], gate rows first
                tensor = deinterleave(tensor).transpose(1, 2)
            elif rest == "experts.gate_up_proj_bias":
                tensor = deinterleave(tensor)
            elif rest == "experts.down_proj":  # [E, I, H] -> [E, H, I]
                tensor = tensor.transpose(1, 2)
            yield f"{prefix}.moe.{_MOE_NAMES[rest]}", tensor
