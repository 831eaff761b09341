"""Gemma 3 text models (`gemma3_text`, and the language model of a multimodal `gemma3` checkpoint).

The Llama decoder with Gemma's choices, all as ModelConfig fields: sliding-window and global
layers alternating by the config's `layer_types`, each kind with its own rope; per-head query
and key norms; four norms a layer (the attention's and the MLP's outputs are normed before
their residual adds); norms that scale by (1 + weight); embeddings multiplied by sqrt(hidden);
GeGLU (tanh GELU); the softmax scale query_pre_attn_scalar ** -0.5; a tied LM head.

Gemma 2's attention and final-logit soft-capping are not implemented: a config that sets either
is refused rather than served wrong.
"""
from __future__ import annotations

from typing import Any

from engine.execution.models.llama import LlamaForCausalLM
from engine.execution.models.model_config import ModelConfig

# A multimodal checkpoint's language-model prefixes (transformers 5's, and the earlier layout's)
# -> a text model's.
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")


class Gemma3ForCausalLM(LlamaForCausalLM):
    PART_NAMES = {"post_attention_layernorm": "pre_feedforward_layernorm",
                  "attn_output_norm": "post_attention_layernorm", "mlp_output_norm": "post_feedforward_layernorm"}
    NORM_WEIGHT_OFFSET = 1.0

    @classmethod
    def config_from_hf(cls, hf: Any) -> ModelConfig:
        text = getattr(hf, "text_config", None) or hf  # a multimodal config holds the text model's
        for field in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(text, field, None) is not None:
                raise ValueError(f"model: {field} (Gemma 2-style soft-capping) is not supported")
        if getattr(text, "use_bidirectional_attention", False):
            raise ValueError("model: use_bidirectional_attention (an embedding model) is not supported for generation")
        act = getattr(text, "hidden_activation", None) or getattr(text, "hidden_act", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"model: hidden_activation {act!r} is not supported; Gemma 3 uses gelu_pytorch_tanh")
        cfg = ModelConfig.from_hf(text, qkv_bias=bool(getattr(text, "attention_bias", False)),
                                  o_proj_bias=bool(getattr(text, "attention_bias", False)), qk_norm=True,
                                  sandwich_norms=True, hidden_act="gelu_tanh", embed_scale=text.hidden_size**0.5,
                                  attn_scale=text.query_pre_attn_scalar**-0.5)
        cfg.model_type = hf.model_type
        # Gemma 3's LM head is its embedding, whatever a multimodal config's top level says.
        cfg.tie_word_embeddings = bool(getattr(text, "tie_word_embeddings", True))
        return cfg

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith(_VISION_PREFIXES):
            return None
        for prefix, text in _TEXT_PREFIXES:
            if name.startswith(prefix):
                return text + name[len(prefix):]
        return name
