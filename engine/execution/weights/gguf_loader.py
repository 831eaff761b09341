"""A model's weights straight from a GGUF file: each projection keeps the file's quantized blocks.

The caller builds the model on the meta device (no float copy of a projection is ever made), then:
- each Linear whose checkpoint tensors (q, k, v fused into one; gate, up into one) are blocks of
  one type with kernels gets a QuantizedWeight of them, attached as `linear.quantized` (the CPU
  backend packs it for the kernels; the Linear's own weight stays on the meta device);
- a fused projection whose parts mix block types (Q4_K_M files store V in Q6_K beside Q4_K) keeps
  each run of one type in its own blocks (a QuantizedParts: q and k Q4_K panels, then v's Q6_K
  ones) where each run but the last fills whole 16-row panels; otherwise (or with a part in a
  type without kernels) it is requantized once to Q8_0, the closest type the kernels share,
  with a log line naming it and why;
- a quantized embedding keeps its blocks too (`embed_tokens.quantized`), and so does a tied LM
  head, which reads the same QuantizedWeight;
- every other tensor (norms, float projections, types without kernels, which GGUFFile has
  dequantized once) becomes a float32 parameter.
Tensor names are mapped from llama.cpp's (blk.N.attn_q ...) to Hugging Face's, per architecture
(llama.cpp's `ffn_norm` is the norm before the MLP: Llama's post_attention_layernorm, Gemma 3's
pre_feedforward_layernorm), and the model's own `_expected_weights` says which tensors it needs: a
missing or unknown one fails naming it.

Gemma 3's RMSNorms scale by (1 + w); llama.cpp's converter stores every one of its norm weights
(the layers', the query / key norms and the final one) with the 1 already added. They are set on
the model as the file holds them, 1 + w: that is the value the Gemma 3 model's own load_weights
folds its Hugging Face checkpoint's w into, so adding 1 again here would be wrong.
"""
from __future__ import annotations

import logging

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from torch import nn

from engine.execution.weights.gguf_file import LAYER_TENSOR, GGUFFile, GGUFTensor
from engine.execution.weights.quantized_parts import MAX_PARTS, QuantizedParts
from engine.execution.weights.quantized_weight import PANEL, QuantizedWeight

logger = logging.getLogger(__name__)

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
                "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# Per architecture, the layer tensors beyond (or named otherwise than) llama's.
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_ARCH_LAYER_NAMES = {
    "qwen3": _LAYER_NAMES | _QK_NORMS,
    "gemma3": _LAYER_NAMES | _QK_NORMS | {"post_attention_norm": "post_attention_layernorm",
                                          "ffn_norm": "pre_feedforward_layernorm",
                                          "post_ffw_norm": "post_feedforward_layernorm"},
}
# Tensors some files carry that the model computes itself (llama 3's RoPE frequencies).
_IGNORED = ("rope_freqs.weight",)


def hf_name(gguf_name: str, architecture: str) -> str | None:
    """llama.cpp's tensor name in a file of `architecture` -> Hugging Face's; None for an unknown one."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    layer_names = _ARCH_LAYER_NAMES.get(architecture, _LAYER_NAMES)
    match = LAYER_TENSOR.match(gguf_name)
    if match is None or match.group(2) not in layer_names:
        return None
    return f"model.layers.{match.group(1)}.{layer_names[match.group(2)]}.{match.group(3)}"


def _float(t: GGUFTensor) -> torch.Tensor:
    return torch.from_numpy(np.array(t.data, dtype=np.float32).reshape(t.shape))


def _runs_of_one_type(parts: list[GGUFTensor]) -> list[list[GGUFTensor]]:
    """Consecutive parts grouped by block type (Q4_K_M's q, k | v)."""
    runs: list[list[GGUFTensor]] = []
    for t in parts:
        if runs and runs[-1][0].quant_type == t.quant_type:
            runs[-1].append(t)
        else:
            runs.append([t])
    return runs


def _quantized(name: str, parts: list[GGUFTensor], in_features: int,
               bias: torch.Tensor | None) -> QuantizedWeight | QuantizedParts:
    """One projection from its checkpoint parts' blocks, stacked by rows (q, k, v; gate, up)."""
    types = {t.quant_type for t in parts}
    if len(types) == 1 and all(t.is_blocks for t in parts):
        blocks = np.concatenate([t.data for t in parts], axis=0)
        return QuantizedWeight.pack(blocks, parts[0].quant_type, in_features, bias)
    runs = _runs_of_one_type(parts)
    run_rows = [sum(t.shape[0] for t in run) for run in runs]
    if all(t.is_blocks for t in parts) and QuantizedParts.fits(run_rows):
        return QuantizedParts.of([QuantizedWeight.pack(np.concatenate([t.data for t in run], axis=0), run[0].quant_type,
                                                       in_features) for run in runs], bias)
    why = ("some are not block types with kernels" if not all(t.is_blocks for t in parts)
           else f"their runs of one type have {run_rows} rows, not up to {MAX_PARTS} runs of whole {PANEL}-row panels")
    logger.info("GGUF %s: its parts are of types %s and %s; requantized once to Q8_0 (the kernels' common type)",
                name, ", ".join(sorted(t.name for t in types)), why)
    values = np.concatenate([dequantize(t.data, t.quant_type).reshape(t.shape) if t.is_blocks
                             else np.asarray(t.data, np.float32).reshape(t.shape) for t in parts], axis=0)
    return QuantizedWeight.pack(quantize(values.astype(np.float32), GGMLQuantizationType.Q8_0),
                                GGMLQuantizationType.Q8_0, in_features, bias)


def _set_parameter(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(module_name), attr, nn.Parameter(value, requires_grad=False))


def load_gguf_weights(model: nn.Module, gguf: GGUFFile) -> nn.Module:
    """`model` (built on the meta device; any family: it names its tensors by `_expected_weights`
    and says by `config.tie_word_embeddings` whether its LM head is its embedding) with gguf's
    weights: quantized projections and embedding as QuantizedWeights (`.quantized` on their
    modules), everything else float32. Modules are matched as torch's Linear and Embedding, so
    this format code needs no import of the model families."""
    tie_word_embeddings = model.config.tie_word_embeddings
    tensors: dict[str, GGUFTensor] = {}
    for t in gguf.tensors():
        name = hf_name(t.name, gguf.architecture)
        if name is None:
            if t.name in _IGNORED:
                continue
            raise ValueError(f"model: GGUF tensor {t.name!r} of {gguf.path.name} has no place in a "
                             f"{gguf.architecture} model")
        if name == "lm_head.weight" and tie_word_embeddings:
            continue
        tensors[name] = t
    expected = model._expected_weights()  # our key (param or param#shard) -> its HF name
    missing = [hf for hf in expected.values() if hf not in tensors]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"model: GGUF file {gguf.path.name} lacks tensors for {', '.join(missing[:5])}{more}")
    unknown = sorted(set(tensors) - set(expected.values()))
    if unknown:
        raise ValueError(f"model: GGUF file {gguf.path.name} has tensors this model does not use: {', '.join(unknown[:5])}")

    def parts(param: str) -> list[GGUFTensor]:
        keys = sorted(key for key in expected if key == param or key.startswith(f"{param}#"))
        return [tensors[expected[key]] for key in keys]

    done: set[int] = set()
    for module_name, module in model.named_modules():
        if not isinstance(module, nn.Linear | nn.Embedding) or id(module.weight) in done:
            continue
        done.add(id(module.weight))
        weight = parts(f"{module_name}.weight")
        bias_parts = parts(f"{module_name}.bias") if getattr(module, "bias", None) is not None else []
        bias = torch.cat([_float(t) for t in bias_parts]) if bias_parts else None
        in_features = module.weight.shape[1]
        if bias is not None:
            _set_parameter(model, f"{module_name}.bias", bias)
        if any(t.is_blocks for t in weight):
            module.quantized = _quantized(module_name, weight, in_features, bias)
        else:
            _set_parameter(model, f"{module_name}.weight", torch.cat([_float(t) for t in weight]))
    if tie_word_embeddings:
        embedding = model.embed_tokens
        model.lm_head.weight = embedding.weight
        if hasattr(embedding, "quantized"):
            model.lm_head.quantized = embedding.quantized
    for name, param in list(model.named_parameters()):
        if param.is_meta and not hasattr(model.get_submodule(name.rpartition(".")[0]), "quantized"):
            _set_parameter(model, name, _float(tensors[expected[name]]))
    return model.eval()
