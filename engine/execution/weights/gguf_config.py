"""A GGUF file's model config and end-of-turn tokens, read from its metadata as llama.cpp reads them.

transformers parses the metadata into its config class, but misses some of what llama.cpp's
converter stores and llama.cpp itself assumes:
- a head's width: the converter writes attention.key_length (Qwen3's and Gemma 3's heads are wider
  than hidden size / heads); transformers keeps the config class's default for qwen3 (128);
- Gemma 3's query scale: the converter stores no query_pre_attn_scalar, and llama.cpp scales by
  1/sqrt(head width), except in the 62-layer (27B) model, by 1/sqrt(hidden / heads);
  transformers keeps its default, 256;
- Gemma 3's layer kinds: llama.cpp takes every sixth layer for global and the rest for sliding
  (attention.sliding_window_pattern, a period or a flag per layer, where a file has one), and
  every layer for global where the file has no sliding window; transformers' default pattern is
  the same six, but its default window applies where the file has none;
- Qwen3-MoE's experts (_set_experts): their width, the renormalised top-k weights llama.cpp
  always uses, and which layers are sparse;
- RoPE: the sliding layers' base (rope.freq_base_swa) and a linear scaling of the others
  (rope.scaling.type / rope.scaling.factor, Gemma 3 4B and up); another scaling type fails,
  naming it, rather than serving positions wrongly;
- bert: transformers has no GGUF reader for it; its BertConfig is built here from bert.* (the
  token types' count from tokenizer.ggml.token_type_count, or the token_types tensor), with BERT's
  exact GELU (the file names no activation);
- gpt-oss: transformers 5.25's GGUF reader fails on the file's rope.scaling metadata, so its
  config is built here from the metadata as llama.cpp reads it (YaRN from rope.scaling.*, the
  experts' width from expert_feed_forward_length, window and full layers alternating, window
  first); the converter stores no YaRN `truncate`, and the released checkpoints' False is taken;
- end of turn: a chat model's turns end in a token other than its end-of-text one (Gemma's
  <end_of_turn>); llama.cpp stops at tokenizer.ggml.eot_token_id and at control tokens it knows
  by their text, and so do the ids read here (the texts of Qwen's, Gemma's and Llama 3's turns);
- pooling (gguf_pooler_config): the converter writes <arch>.pooling_type for an embedding model
  (from a sentence-transformers directory's Pooling module: mean, cls or lasttoken) and rank for
  a reranker (a BERT cross-encoder's file has none, but its classifier, cls.output, without the
  pooler layer it reads: refused too); llama.cpp's server normalises a pooled embedding
  (Euclidean, its default embd_normalize 2), whatever the file, and refuses OpenAI's embeddings
  for pooling none.
"""
from __future__ import annotations

from typing import Any

from engine.execution.weights.gguf_file import GGUFFile
from engine.processing.pooling_params import PoolerConfig, PoolingType

# Some of the texts llama.cpp's vocabulary loader takes for an end of turn: ChatML's (Qwen), Gemma's
# and Llama 3's. (It stops at more, <|endoftext|> among them; those are left to the file's own eos.)
_END_OF_TURN_TEXTS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>")
_CONTROL = 3  # llama.cpp's token type of control tokens
_GEMMA3_27B_LAYERS = 62
_GEMMA3_SWA_PERIOD = 6  # llama.cpp's default: layers 5, 11, ... global
# llama.cpp's pooling types (enum llama_pooling_type; gguf-py's PoolingType) -> ours. 0, none, and
# no key at all: a model that pools nothing (a generator's file).
_POOLING_NONE, _POOLING_RANK = 0, 4
_POOLING_TYPES = {1: PoolingType.MEAN, 2: PoolingType.CLS, 3: PoolingType.LAST}
# A sequence classifier's head as the converter writes it (a BERT cross-encoder's classifier; no
# pooling_type: it writes one from a sentence-transformers Pooling module only).
_CLASSIFIER_TENSORS = ("cls.weight", "cls.output.weight")


def gguf_config(file: GGUFFile) -> Any:
    """transformers' config of a GGUF file, completed and corrected from its metadata."""
    from transformers import AutoConfig

    if file.architecture == "gpt-oss":
        return _gpt_oss_config(file)
    if file.architecture == "bert":
        return _bert_config(file)
    config = AutoConfig.from_pretrained(str(file.path.parent), gguf_file=file.path.name)
    head_dim = file.arch_field("attention.key_length")
    if head_dim is not None:
        config.head_dim = int(head_dim)
    if file.architecture in ("qwen3", "qwen3moe", "gemma3"):
        _set_rope(file, config)
    if file.architecture == "qwen3moe":
        _set_experts(file, config)
    if file.architecture == "gemma3":
        if config.num_hidden_layers == _GEMMA3_27B_LAYERS:
            config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads
        else:
            config.query_pre_attn_scalar = config.head_dim
        config.layer_types = _gemma3_layer_types(file, config.num_hidden_layers)
    return config


def _gpt_oss_config(file: GGUFFile) -> Any:
    from transformers import GptOssConfig

    def number(key: str, default: Any = None) -> Any:
        value = file.arch_field(key, default)
        if value is None:
            raise ValueError(f"model: GGUF file {file.path.name} lacks gpt-oss.{key}")
        return value

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(number("rope.freq_base", 150000.0))}
    scaling = str(file.arch_field("rope.scaling.type", "none"))
    if scaling == "yarn":
        rope.update(rope_type="yarn", factor=float(number("rope.scaling.factor")),
                    original_max_position_embeddings=int(number("rope.scaling.original_context_length")),
                    beta_fast=float(number("rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(number("rope.scaling.yarn_beta_slow", 1.0)), truncate=False)
        attn_factor = file.arch_field("rope.scaling.yarn_attn_factor")
        if attn_factor is not None:
            rope["attention_factor"] = float(attn_factor)
    elif scaling != "none":
        raise ValueError(f"model: GGUF file {file.path.name} scales RoPE by {scaling!r}; gpt-oss reads yarn only")
    names = {name for name in file.tensor_names()}
    tokens = file.field("tokenizer.ggml.tokens", [])
    heads = int(number("attention.head_count"))
    hidden = int(number("embedding_length"))
    special = {key: file.field(f"tokenizer.ggml.{key}_token_id") for key in ("bos", "eos", "padding")}
    return GptOssConfig(
        vocab_size=int(file.arch_field("vocab_size") or len(tokens)), hidden_size=hidden,
        intermediate_size=int(file.arch_field("expert_feed_forward_length") or number("feed_forward_length")),
        num_hidden_layers=int(number("block_count")), num_attention_heads=heads,
        num_key_value_heads=int(file.arch_field("attention.head_count_kv", heads)),
        head_dim=int(file.arch_field("attention.key_length", hidden // heads)),
        max_position_embeddings=int(number("context_length")),
        rms_norm_eps=float(number("attention.layer_norm_rms_epsilon")),
        num_local_experts=int(number("expert_count")), num_experts_per_tok=int(number("expert_used_count")),
        sliding_window=int(number("attention.sliding_window")), rope_parameters=rope,
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=special["bos"], eos_token_id=special["eos"], pad_token_id=special["padding"])


def _bert_config(file: GGUFFile) -> Any:
    """A BertModel's config from bert.* (transformers reads no bert GGUF file). The file records no
    activation: BERT's exact GELU, as the checkpoints llama.cpp's bert architecture takes
    (BertModel: bge, e5, all-MiniLM) run it in transformers and sentence-transformers (llama.cpp's
    own graph runs ggml's tanh approximation)."""
    from transformers import BertConfig

    def number(key: str) -> Any:
        value = file.arch_field(key)
        if value is None:
            raise ValueError(f"model: GGUF file {file.path.name} lacks bert.{key}")
        return value

    num_token_types = file.field("tokenizer.ggml.token_type_count")
    if num_token_types is None:
        shape = file.tensor_shape("token_types.weight")
        num_token_types = 1 if shape is None else shape[0]
    return BertConfig(
        vocab_size=len(file.field("tokenizer.ggml.tokens", [])), hidden_size=int(number("embedding_length")),
        num_hidden_layers=int(number("block_count")), num_attention_heads=int(number("attention.head_count")),
        intermediate_size=int(number("feed_forward_length")), hidden_act="gelu",
        max_position_embeddings=int(number("context_length")), type_vocab_size=int(num_token_types),
        layer_norm_eps=float(number("attention.layer_norm_epsilon")),
        pad_token_id=int(file.field("tokenizer.ggml.padding_token_id", 0)), architectures=["BertModel"])


def _set_experts(file: GGUFFile, config: Any) -> None:
    """Qwen3-MoE's experts as llama.cpp runs them: each expert's width from
    expert_feed_forward_length (transformers leaves its class default), the chosen k weights
    always renormalised (llama.cpp's qwen3moe graph passes norm_w = true; the file stores no
    flag), and every layer sparse that has a router (llama.cpp's files: all of them)."""
    expert_ff = file.arch_field("expert_feed_forward_length")
    if expert_ff is not None:
        config.moe_intermediate_size = int(expert_ff)
    config.num_experts = int(file.arch_field("expert_count"))
    config.num_experts_per_tok = int(file.arch_field("expert_used_count"))
    config.norm_topk_prob = True
    routed = set(file.tensor_names())
    config.decoder_sparse_step = 1
    config.mlp_only_layers = [i for i in range(config.num_hidden_layers) if f"blk.{i}.ffn_gate_inp.weight" not in routed]


def _gemma3_layer_types(file: GGUFFile, num_layers: int) -> list[str]:
    if not file.arch_field("attention.sliding_window"):
        return ["full_attention"] * num_layers
    pattern = file.arch_field("attention.sliding_window_pattern", _GEMMA3_SWA_PERIOD)
    if isinstance(pattern, list):
        is_sliding = [bool(flag) for flag in pattern[:num_layers]]
    else:
        period = int(pattern)
        is_sliding = [period == 0 or i % period < period - 1 for i in range(num_layers)]
    return ["sliding_attention" if sliding else "full_attention" for sliding in is_sliding]


def _set_rope(file: GGUFFile, config: Any) -> None:
    scaling = str(file.arch_field("rope.scaling.type", "none"))
    if scaling not in ("none", "linear"):
        raise ValueError(f"model: GGUF file {file.path.name} scales RoPE by {scaling!r}; only linear scaling is "
                         f"read for {file.architecture}")
    params = config.rope_parameters
    full = params.get("full_attention", params)  # Gemma 3: a set per layer kind
    if scaling == "linear":
        full.update(rope_type="linear", factor=float(file.arch_field("rope.scaling.factor")))
    swa_theta = file.arch_field("rope.freq_base_swa")
    if swa_theta is not None and "sliding_attention" in params:
        params["sliding_attention"]["rope_theta"] = float(swa_theta)


def gguf_eos_token_ids(file: GGUFFile) -> list[int]:
    """The ids generation stops at: the file's end-of-text and end-of-turn tokens, and its control
    tokens whose text llama.cpp takes for an end of turn."""
    ids = [int(file.field(key)) for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
           if file.field(key) is not None]
    tokens = file.field("tokenizer.ggml.tokens", [])
    types = file.field("tokenizer.ggml.token_type", [])
    for text in _END_OF_TURN_TEXTS:
        if text in tokens:
            index = tokens.index(text)
            if index < len(types) and int(types[index]) == _CONTROL:
                ids.append(index)
    return list(dict.fromkeys(ids))


def gguf_pooler_config(file: GGUFFile) -> PoolerConfig | None:
    """The pooling an embedding file asks for (<arch>.pooling_type), normalised as llama.cpp's
    server normalises it; None for a file that pools nothing. ValueError for a reranker's file
    (rank: its score is a head the converter cut from the LM head's yes / no rows, not read here;
    or a BERT cross-encoder's classifier, cls.output, whose input the converter drops: BERT's
    pooler layer) or a type llama.cpp does not define."""
    value = file.arch_field("pooling_type")
    has_head = any(name in _CLASSIFIER_TENSORS for name in file.tensor_names())
    if has_head or (value is not None and int(value) == _POOLING_RANK):
        why = "pooling_type rank" if not has_head else "a classifier head, cls.output"
        raise ValueError(f"model: GGUF file {file.path.name} is a reranker ({why}); its scores are not served from a "
                         "GGUF file: serve the reranker's Hugging Face checkpoint with --task score")
    if value is None or int(value) == _POOLING_NONE:
        return None
    if int(value) not in _POOLING_TYPES:
        raise ValueError(f"model: GGUF file {file.path.name} has pooling_type {value}, which llama.cpp does not define "
                         "(0 none, 1 mean, 2 cls, 3 last, 4 rank)")
    return PoolerConfig(_POOLING_TYPES[int(value)], normalize=True)
