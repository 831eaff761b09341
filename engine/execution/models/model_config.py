"""The architecture facts the model code needs, read once from a transformers config."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.execution.models.moe import MoeConfig


@dataclass(frozen=True, slots=True)
class Rope:
    """One rotary embedding: its inverse frequencies and the attention factor some variants
    apply to cos/sin (1.0 for most)."""

    inv_freq: torch.Tensor  # [head_dim // 2] float32
    scale: float


@dataclass(frozen=True, slots=True)
class EncoderConfig:
    """What a BERT-family encoder adds to the shared facts: learned absolute positions (RoBERTa's
    start past its padding id) and segment (token type) embeddings. Its attention is
    bidirectional over the whole prompt."""

    type_vocab_size: int
    position_offset: int = 0  # the first token's position id (RoBERTa: padding_idx + 1)


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
    # The distinct rotary embeddings (Gemma 3: one for its global layers, one for its window
    # layers) and, per layer, the index of the one it uses.
    ropes: tuple[Rope, ...]
    layer_ropes: tuple[int, ...]
    # Per layer: None (full causal attention) or W (a query sees itself and the W - 1 keys before it).
    sliding_windows: tuple[int | None, ...]
    attn_scale: float = 0.0  # softmax scale of the scores; 0: head_dim ** -0.5
    qk_norm: bool = False  # RMSNorm over each head's query and key before RoPE (Qwen3, Gemma 3)
    # Gemma's four norms a layer: the attention's and the MLP's outputs are normed before their
    # residual adds, besides the usual norms of their inputs.
    sandwich_norms: bool = False
    hidden_act: str = "silu"  # the gated MLP's activation: silu or gelu_tanh (GeGLU)
    embed_scale: float | None = None  # Gemma multiplies the embeddings by sqrt(hidden)
    # Mixture-of-experts families: the experts' recipe, and per layer whether its MLP is the
    # sparse one (Qwen3-MoE's decoder_sparse_step / mlp_only_layers leave some dense).
    moe: MoeConfig | None = None
    moe_layers: tuple[bool, ...] = ()
    # gpt-oss: a learned logit per query head that joins each softmax's denominator (a "sink" the
    # head can put weight on instead of any key), held by the layer as `sinks` [num_heads].
    attn_sinks: bool = False
    # An encoder (BERT): bidirectional attention over the whole prompt, so a prompt cannot be
    # split over steps and keeps no KV after its step; None for every decoder.
    encoder: EncoderConfig | None = None
    # A reranker's score head (`score_head`, on the pooled final-normed state): a sequence
    # classifier's projection of num_labels rows (a decoder's `score.weight` in place of an LM head
    # on its last token; a BERT cross-encoder's pooler and classifier on its [CLS]), or, for a
    # causal LM served with --task score, the LM head's logits of score_token_ids (Qwen3-Reranker's
    # no, yes: one label, logit(yes) - logit(no)).
    num_labels: int = 0
    score_token_ids: tuple[int, ...] = ()

    @property
    def is_causal(self) -> bool:
        """Whether a token attends only to those before it: a prompt may then be prefilled in
        chunks (and its K/V reused); an encoder's cannot."""
        return self.encoder is None

    def is_moe_layer(self, layer_index: int) -> bool:
        return self.moe is not None and self.moe_layers[layer_index]

    def __post_init__(self) -> None:
        if not self.attn_scale:
            self.attn_scale = self.head_dim**-0.5

    @property
    def inv_freq(self) -> torch.Tensor:
        """The first rope's frequencies (every layer's, in a model with one)."""
        return self.ropes[0].inv_freq

    @property
    def rope_scale(self) -> float:
        return self.ropes[0].scale

    @classmethod
    def from_hf(cls, hf: Any, qkv_bias: bool | None = None, o_proj_bias: bool = False, **family: Any) -> ModelConfig:
        """family: the fields a family sets beyond Llama's (qk_norm, sandwich_norms, hidden_act,
        embed_scale, attn_scale)."""
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        ropes, layer_ropes = _ropes(hf, head_dim)
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
            ropes=ropes,
            layer_ropes=layer_ropes,
            sliding_windows=_sliding_windows(hf),
            num_labels=hf.num_labels if is_sequence_classifier(hf) else 0,
            **family,
        )


def is_sequence_classifier(hf: Any) -> bool:
    """The checkpoint is a *ForSequenceClassification (a cross-encoder or a converted reranker)."""
    return any(name.endswith("ForSequenceClassification") for name in getattr(hf, "architectures", None) or ())


def _sliding_windows(hf: Any) -> tuple[int | None, ...]:
    """As transformers decides it: `layer_types` names the sliding layers where the config has
    it (Qwen2 after `use_sliding_window`/`max_window_layers`); otherwise a set `sliding_window`
    applies to every layer (Mistral)."""
    window = getattr(hf, "sliding_window", None)
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is not None:
        return tuple(window if kind == "sliding_attention" and window else None for kind in layer_types)
    return (window or None,) * hf.num_hidden_layers


def _ropes(hf: Any, head_dim: int) -> tuple[tuple[Rope, ...], tuple[int, ...]]:
    """The distinct ropes and each layer's. A config whose `rope_parameters` are keyed by layer
    type (Gemma 3: full_attention, sliding_attention) has one rope per type; others one."""
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is not None and all(kind in params for kind in set(layer_types)):
        kinds = sorted(set(layer_types))
        ropes = tuple(_rope(hf, head_dim, params[kind], kind) for kind in kinds)
        return ropes, tuple(kinds.index(kind) for kind in layer_types)
    return (_rope(hf, head_dim, params, None),), (0,) * hf.num_hidden_layers


def _rope(hf: Any, head_dim: int, params: dict[str, Any], layer_type: str | None) -> Rope:
    """RoPE inverse frequencies. Non-default types reuse transformers' own init functions
    so scaled variants (llama3, linear, yarn...) match it exactly."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return Rope(1.0 / (theta**exponent), 1.0)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu", **kwargs)
    return Rope(inv_freq.float(), float(scale))
