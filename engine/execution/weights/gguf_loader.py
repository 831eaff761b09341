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
- a mixture-of-experts layer's stacked experts (ffn_gate_exps / ffn_up_exps / ffn_down_exps, [E, ...])
  are split by expert; where they are blocks (Qwen3-MoE's K-quants, gpt-oss's MXFP4) each expert
  gets QuantizedWeights of its own (`experts.quantized_gate_up`: its gate rows then its up rows;
  `experts.quantized_down`), the stacked float parameters left on the meta device, no float copy
  made; their biases (gpt-oss's, float in the file) become the experts' float bias parameters;
  the router (ffn_gate_inp, with gpt-oss's bias) is a Linear as any;
- a quantized embedding keeps its blocks too (`embed_tokens.quantized`), and so does a tied LM
  head, which reads the same QuantizedWeight; any other embedding in blocks (a position or token
  type table: BERT's, which llama.cpp's converter keeps float32) is dequantized to float32;
- every other tensor (norms, float projections, types without kernels, which GGUFFile has
  dequantized once) becomes a float32 parameter.
Tensor names are mapped from llama.cpp's (blk.N.attn_q ...) to Hugging Face's, per architecture
(llama.cpp's `ffn_norm` is the norm before the MLP: Llama's post_attention_layernorm, Gemma 3's
pre_feedforward_layernorm), and the model's own `_expected_weights` says which tensors it needs: a
missing or unknown one fails naming it.

gpt-oss's experts: llama.cpp's converter splits transformers' into ffn_gate_exps / ffn_up_exps
[E, I, H] (the interleaved gate and up columns taken apart) and ffn_down_exps [E, H, I], with
biases, so they load as any file's. For quantization none, whose conversion to a safetensors
directory reads other families' files with transformers (which fails on gpt-oss's),
hf_float_tensors reads a gpt-oss file as float32 (blocks dequantized by the gguf package) in
transformers' layout: gate and up put back together (mlp.experts.gate_up_proj [E, H, 2I]
interleaved, down_proj [E, I, H]).

bert (an embedder's file: BertModel's tensors, llama.cpp's token_embd / position_embd /
token_types / token_embd_norm and per layer attn_q/k/v, attn_output, attn_output_norm, ffn_up,
ffn_down, layer_output_norm, each with its bias) maps to BertModel's checkpoint names
(embeddings.*, encoder.layer.N.*); transformers has no GGUF reader for it, so quantization none
reads it through hf_float_tensors too. A cross-encoder's head (cls, cls.output) is not mapped:
such a file is refused as a reranker before any tensor is read (gguf_config.gguf_pooler_config).

Gemma 3's RMSNorms scale by (1 + w); llama.cpp's converter stores every one of its norm weights
(the layers', the query / key norms and the final one) with the 1 already added. They are set on
the model as the file holds them, 1 + w: that is the value the Gemma 3 model's own load_weights
folds its Hugging Face checkpoint's w into, so adding 1 again here would be wrong.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator

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
# A mixture-of-experts layer's router, and its experts' projections stacked in one tensor each
# ([E, ...]; the loader splits them into Hugging Face's per-expert names, mlp.experts.N.gate_proj).
_EXPERTS = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
            "ffn_down_exps": "mlp.experts.down_proj"}
# BERT's tensors (bert.py's checkpoint names, without a task model's prefix): the embeddings', and
# each layer's under encoder.layer.N.
_BERT_GLOBAL_NAMES = {"token_embd.weight": "embeddings.word_embeddings.weight",
                      "position_embd.weight": "embeddings.position_embeddings.weight",
                      "token_types.weight": "embeddings.token_type_embeddings.weight",
                      "token_embd_norm.weight": "embeddings.LayerNorm.weight",
                      "token_embd_norm.bias": "embeddings.LayerNorm.bias"}
_BERT_LAYER_NAMES = {"attn_q": "attention.self.query", "attn_k": "attention.self.key",
                     "attn_v": "attention.self.value", "attn_output": "attention.output.dense",
                     "attn_output_norm": "attention.output.LayerNorm", "ffn_up": "intermediate.dense",
                     "ffn_down": "output.dense", "layer_output_norm": "output.LayerNorm"}
_ARCH_LAYER_NAMES = {
    "qwen3": _LAYER_NAMES | _QK_NORMS,
    "qwen3moe": _LAYER_NAMES | _QK_NORMS | _EXPERTS,
    "gemma3": _LAYER_NAMES | _QK_NORMS | {"post_attention_norm": "post_attention_layernorm",
                                          "ffn_norm": "pre_feedforward_layernorm",
                                          "post_ffw_norm": "post_feedforward_layernorm"},
    "gpt-oss": _LAYER_NAMES | _EXPERTS | {"post_attention_norm": "post_attention_layernorm",
                                          "attn_sinks": "self_attn.sinks", "ffn_gate_inp": "mlp.router"},
    "bert": _BERT_LAYER_NAMES,
}
_ARCH_GLOBAL_NAMES = {"bert": _BERT_GLOBAL_NAMES}
_ARCH_LAYER_PREFIX = {"bert": "encoder.layer"}  # others': model.layers
# The architectures whose files hf_float_tensors reads for quantization none (transformers has no
# GGUF reader for bert, and fails on gpt-oss's metadata).
FLOAT_READ_ARCHITECTURES = ("gpt-oss", "bert")
# gpt-oss's experts as hf_float_tensors joins them into transformers' tensors.
_GPT_OSS_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# Tensors some files carry that the model computes itself (llama 3's RoPE frequencies).
_IGNORED = ("rope_freqs.weight",)
_STACKED_EXPERTS = re.compile(r"(.*\.experts)\.(\w+)\.(weight|bias)$")  # a stacked tensor's HF name


def hf_name(gguf_name: str, architecture: str) -> str | None:
    """llama.cpp's tensor name in a file of `architecture` -> Hugging Face's; None for an unknown one."""
    global_names = _ARCH_GLOBAL_NAMES.get(architecture, _GLOBAL_NAMES)
    if gguf_name in global_names:
        return global_names[gguf_name]
    layer_names = _ARCH_LAYER_NAMES.get(architecture, _LAYER_NAMES)
    match = LAYER_TENSOR.match(gguf_name)
    if match is None or match.group(2) not in layer_names:
        return None
    prefix = _ARCH_LAYER_PREFIX.get(architecture, "model.layers")
    if match.group(2) == "attn_sinks":  # a bare parameter in transformers, not a module's weight
        return f"{prefix}.{match.group(1)}.self_attn.sinks"
    return f"{prefix}.{match.group(1)}.{layer_names[match.group(2)]}.{match.group(3)}"


def _mapped_name(t: GGUFTensor, gguf: GGUFFile) -> str | None:
    """t's Hugging Face name; None for a tensor the model computes itself (_IGNORED). Raises
    ValueError naming a tensor with no place in the file's architecture."""
    name = hf_name(t.name, gguf.architecture)
    if name is None and t.name not in _IGNORED:
        raise ValueError(f"model: GGUF tensor {t.name!r} of {gguf.path.name} has no place in a "
                         f"{gguf.architecture} model")
    return name


def _values(t: GGUFTensor) -> torch.Tensor:
    """A tensor's float32 values, blocks dequantized."""
    if t.is_blocks:
        return torch.from_numpy(np.ascontiguousarray(dequantize(t.data, t.quant_type)).reshape(t.shape))
    return _float(t)


def hf_float_tensors(gguf: GGUFFile) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a gpt-oss or bert file as float32 under transformers' name and in its
    layout (module docstring). Raises ValueError naming a tensor with no place in the model."""
    if gguf.architecture not in FLOAT_READ_ARCHITECTURES:  # others' is transformers' (Gemma's norms, llama's rows)
        raise ValueError(f"model: {gguf.path.name}: float tensors are read here for "
                         f"{' and '.join(FLOAT_READ_ARCHITECTURES)} only, not {gguf.architecture}")
    experts: dict[tuple[str, str, str], torch.Tensor] = {}  # (layer, part, weight | bias) -> values
    for t in gguf.tensors():
        match = LAYER_TENSOR.match(t.name)
        if match is not None and match.group(2) in _GPT_OSS_EXPERTS:
            experts[match.groups()] = _values(t)
            continue
        name = _mapped_name(t, gguf)
        if name is not None:
            yield name, _values(t)
    for layer in sorted({key[0] for key in experts}, key=int):
        prefix = f"model.layers.{layer}.mlp.experts"
        for kind, suffix in (("weight", ""), ("bias", "_bias")):
            parts = [experts.get((layer, part, kind)) for part in _GPT_OSS_EXPERTS]
            if any(p is None for p in parts):
                raise ValueError(f"model: GGUF file {gguf.path.name} lacks blk.{layer}'s expert {kind}s "
                                 f"({', '.join(_GPT_OSS_EXPERTS)})")
            gate, up, down = parts
            # [E, I, H] each (weights) or [E, I] (biases) -> gate and up alternating along I
            gate_up = torch.stack((gate, up), dim=2).flatten(1, 2)
            if kind == "weight":
                gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)  # [E, H, 2I], [E, I, H]
            yield f"{prefix}.gate_up_proj{suffix}", gate_up.contiguous()
            yield f"{prefix}.down_proj{suffix}", down.contiguous()


def _split_experts(name: str, t: GGUFTensor) -> dict[str, GGUFTensor]:
    """A stacked experts tensor ([E, ...]) as each expert's, by Hugging Face's per-expert names:
    model.layers.N.mlp.experts.gate_proj.weight -> ...experts.0.gate_proj.weight, ... (blocks: each
    expert's rows of blocks; floats: its slice)."""
    match = _STACKED_EXPERTS.match(name)
    prefix, proj, kind = match.group(1), match.group(2), match.group(3)
    num_experts, shape = t.shape[0], t.shape[1:]
    rows = int(np.prod(shape[:-1]))
    data = t.data.reshape(num_experts, rows, -1) if t.is_blocks else t.data.reshape(t.shape)
    return {f"{prefix}.{e}.{proj}.{kind}": GGUFTensor(f"{t.name}[{e}]", t.quant_type, shape, data[e])
            for e in range(num_experts)}


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


def _quantized(name: str, parts: list[GGUFTensor], in_features: int, bias: torch.Tensor | None,
               can_mix: bool = True) -> QuantizedWeight | QuantizedParts:
    """One projection from its checkpoint parts' blocks, stacked by rows (q, k, v; gate, up).
    can_mix: whether the caller runs QuantizedParts (an expert's gate_up is run by the experts op,
    which takes one type a product: mixed, it is requantized)."""
    types = {t.quant_type for t in parts}
    if len(types) == 1 and all(t.is_blocks for t in parts):
        blocks = np.concatenate([t.data for t in parts], axis=0)
        return QuantizedWeight.pack(blocks, parts[0].quant_type, in_features, bias)
    runs = _runs_of_one_type(parts)
    run_rows = [sum(t.shape[0] for t in run) for run in runs]
    if can_mix and all(t.is_blocks for t in parts) and QuantizedParts.fits(run_rows):
        return QuantizedParts.of([QuantizedWeight.pack(np.concatenate([t.data for t in run], axis=0), run[0].quant_type,
                                                       in_features) for run in runs], bias)
    why = ("some are not block types with kernels" if not all(t.is_blocks for t in parts)
           else "the experts op takes one type a product" if not can_mix
           else f"their runs of one type have {run_rows} rows, not up to {MAX_PARTS} runs of whole {PANEL}-row panels")
    logger.info("GGUF %s: its parts are of types %s and %s; requantized once to Q8_0 (the kernels' common type)",
                name, ", ".join(sorted(t.name for t in types)), why)
    values = torch.cat([_values(t) for t in parts]).numpy()
    return QuantizedWeight.pack(quantize(values, GGMLQuantizationType.Q8_0),
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
        name = _mapped_name(t, gguf)
        if name is None or (name == "lm_head.weight" and tie_word_embeddings):
            continue
        if _STACKED_EXPERTS.match(name):
            tensors |= _split_experts(name, t)
        else:
            tensors[name] = t
    expected = model._expected_weights()  # our key (param or param#shard) -> its HF name
    missing = [hf for hf in expected.values() if hf not in tensors]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"model: GGUF file {gguf.path.name} lacks tensors for {', '.join(missing[:5])}{more}")
    unknown = sorted(set(tensors) - set(expected.values()))
    if unknown:
        raise ValueError(f"model: GGUF file {gguf.path.name} has tensors this model does not use: {', '.join(unknown[:5])}")

    # param -> its checkpoint keys (param, or param#shard: shards in order, 10 after 9), indexed once:
    # a Qwen3-MoE file has a key per expert projection, tens of thousands
    keys_of: dict[str, list[str]] = {}
    for key in expected:
        keys_of.setdefault(key.partition("#")[0], []).append(key)

    def parts(param: str) -> list[GGUFTensor]:
        keys = sorted(keys_of.get(param, ()), key=lambda key: int(key.partition("#")[2] or -1))
        return [tensors[expected[key]] for key in keys]

    done: set[int] = set()
    for module_name, module in model.named_modules():
        if _is_experts(module):
            _load_experts(model, module_name, module, parts)
            gguf.release(parts(f"{module_name}.gate_up") + parts(f"{module_name}.down"))  # repacked: unmap
            continue
        if not isinstance(module, nn.Linear | nn.Embedding) or id(module.weight) in done:
            continue
        done.add(id(module.weight))
        weight = parts(f"{module_name}.weight")
        bias_parts = parts(f"{module_name}.bias") if getattr(module, "bias", None) is not None else []
        bias = torch.cat([_float(t) for t in bias_parts]) if bias_parts else None
        in_features = module.weight.shape[1]
        if bias is not None:
            _set_parameter(model, f"{module_name}.bias", bias)
        # the backends run blocks for projections and the word embedding (embed_tokens) only
        can_keep_blocks = isinstance(module, nn.Linear) or module is getattr(model, "embed_tokens", None)
        if any(t.is_blocks for t in weight) and can_keep_blocks:
            module.quantized = _quantized(module_name, weight, in_features, bias)
        else:
            _set_parameter(model, f"{module_name}.weight", torch.cat([_values(t) for t in weight]))
        gguf.release(weight)  # repacked or copied: its mapped pages are no longer read
    if tie_word_embeddings:
        embedding = model.embed_tokens
        model.lm_head.weight = embedding.weight
        if hasattr(embedding, "quantized"):
            model.lm_head.quantized = embedding.quantized
    for name, param in list(model.named_parameters()):
        owner = model.get_submodule(name.rpartition(".")[0])
        if param.is_meta and not hasattr(owner, "quantized") and not _is_experts(owner):
            _set_parameter(model, name, _float(tensors[expected[name]]))
    return model.eval()


def _is_experts(module: nn.Module) -> bool:
    """A mixture-of-experts module's stacked experts (models/moe.py's Experts: gate_up [E, 2I, H],
    down [E, H, I]), recognised by its parameters so this format code imports no model code."""
    gate_up, down = getattr(module, "gate_up", None), getattr(module, "down", None)
    return isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3


def _load_experts(model: nn.Module, module_name: str, experts: nn.Module,
                  parts: Callable[[str], list[GGUFTensor]]) -> None:
    """The experts' weights: where the file has blocks, one QuantizedWeight per expert
    (`quantized_gate_up`: its gate rows then its up rows, as a dense gate_up_proj;
    `quantized_down`), the float parameters left on the meta device; else float parameters.
    Their biases (gpt-oss's), float32 [E, 2I] (each expert's gate's, then its up's) and [E, H]."""
    gate_up, down = parts(f"{module_name}.gate_up"), parts(f"{module_name}.down")  # gate_0, up_0, gate_1, ...; down_e
    num_experts, hidden = experts.gate_up.shape[0], experts.gate_up.shape[2]
    for kind in ("gate_up_bias", "down_bias"):
        if getattr(experts, kind, None) is not None:
            rows = [_float(t) for t in parts(f"{module_name}.{kind}")]  # gate_up: gate_0, up_0, gate_1, ...
            _set_parameter(model, f"{module_name}.{kind}", torch.cat(rows).view(num_experts, -1))
    if any(t.is_blocks for t in gate_up + down):
        experts.quantized_gate_up = [_quantized(f"{module_name}[{e}].gate_up", gate_up[2 * e : 2 * e + 2], hidden, None,
                                                can_mix=False)
                                     for e in range(num_experts)]
        experts.quantized_down = [_quantized(f"{module_name}[{e}].down", [down[e]], experts.down.shape[2], None)
                                  for e in range(num_experts)]
        return
    stacked = torch.stack([torch.cat([_float(gate_up[2 * e]), _float(gate_up[2 * e + 1])]) for e in range(num_experts)])
    _set_parameter(model, f"{module_name}.gate_up", stacked)
    _set_parameter(model, f"{module_name}.down", torch.stack([_float(t) for t in down]))
