"""The architecture facts the model code needs, read once from a transformers config."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    inv_freq: torch.Tensor  # [head_dim // 2]
    rope_scale: float  # attention factor some RoPE variants apply to cos/sin
    # Per layer: None (full causal attention) or W (a query sees itself and the W - 1 keys before it).
    sliding_windows: tuple[int | None, ...]

    @classmethod
    def from_hf(cls, hf: Any, qkv_bias: bool | None = None, o_proj_bias: bool = False) -> ModelConfig:
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        inv_freq, rope_scale = _rope_inv_freq(hf, head_dim)
        return cls(
            model_type=hf.model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=bool(getattr(hf, "attention_bias", False)) if qkv_bias is None else qkv_bias,
            o_proj_bias=o_proj_bias,
            inv_freq=inv_freq,
            rope_scale=rope_scale,
            sliding_windows=_sliding_windows(hf),
        )


def _sliding_windows(hf: Any) -> tuple[int | None, ...]:
    """As transformers decides it: `layer_types` names the sliding layers where the config has
    it (Qwen2 after `use_sliding_window`/`max_window_layers`); otherwise a set `sliding_window`
    applies to every layer (Mistral)."""
    window = getattr(hf, "sliding_window", None)
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is not None:
        return tuple(window if kind == "sliding_attention" and window else None for kind in layer_types)
    return (window or None,) * hf.num_hidden_layers


def _rope_inv_freq(hf: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies. Non-default types reuse transformers' own init functions
    so scaled variants (llama3, linear, yarn...) match it exactly."""
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (theta**exponent), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
    return inv_freq.float(), float(scale)
