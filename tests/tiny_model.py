"""Tiny random-weight models with a real byte-level BPE tokenizer, built offline in seconds.

Unit tests run on them so the suite stays fast and needs no download: `build_tiny_model` (the
Llama most tests use) and `build_tiny_family_model` (any supported family, from transformers'
own model classes, for the per-family parity tests). Weights are scaled up from the usual
init so logits are well separated: greedy choices are then stable against float rounding,
and token-for-token comparisons stay meaningful.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_CORPUS = """The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and values
in fixed-size blocks. Prefill processes the whole prompt; decode produces one token at a time.
Hello world! Once upon a time there was a small language model that served many users at once.
def main():\n    print("hello")\n    return 0\nNumbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.
Unicode: café, naïve, 你好, 世界, emoji 🙂 and accents éèê. Questions? Answers! Lists: a, b, c.
"""
_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# A template that knows tools (Hermes-like layout: <tool_call> JSON </tool_call>), for the tool model.
TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n"
    "{% endif %}Functions:\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "Call one as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'system' and tools %}"
    "{% elif message['role'] == 'assistant' and message.get('tool_calls') %}<|im_start|>assistant\n"
    "{{ message['content'] or '' }}{% for call in message['tool_calls'] %}<tool_call>\n"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>")  # added, not special (as in Qwen's)


@dataclass(frozen=True)
class ChatTokens:
    """A tokenizer's chat vocabulary: special tokens (bos, eos and pad among them), added
    tokens that are not special (Qwen's <tool_call> and <think>), and the extra ids that end an
    answer (Gemma's <end_of_turn>, in generation_config.json)."""

    special: tuple[str, ...] = tuple(_SPECIAL)
    added: tuple[str, ...] = ()
    bos: str = "<|endoftext|>"
    eos: str = "<|im_end|>"
    pad: str = "<|endoftext|>"
    extra_eos: tuple[str, ...] = ()


# Qwen2.5/Qwen3's: ChatML markers special, tool-call and thinking markers plain added tokens.
QWEN_TOKENS = ChatTokens(added=TOOL_TOKENS)
# Gemma's: <bos> written by the template itself, turns closed by <end_of_turn> (an eos of generation).
GEMMA_TOKENS = ChatTokens(special=("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
                          bos="<bos>", eos="<eos>", pad="<pad>", extra_eos=("<end_of_turn>",))


def _write_tokenizer(path: Path, vocab_size: int, added_tokens: tuple[str, ...] = (),
                     chat_template: str = _CHAT_TEMPLATE, tokens: ChatTokens | None = None) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokens = tokens or ChatTokens(added=added_tokens)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(tokens.special),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    if tokens.added:
        tok.add_tokens(list(tokens.added))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=tokens.bos, eos_token=tokens.eos,
                                   pad_token=tokens.pad, unk_token=tokens.pad)
    fast.chat_template = chat_template
    fast.save_pretrained(str(path))
    return tok


def build_tiny_tokenizer(path: Path, chat_template: str, tokens: ChatTokens | None = None) -> Any:
    """The tiny tokenizer alone, with a chat template and vocabulary of the caller's, loaded back
    as transformers loads a model's."""
    from transformers import AutoTokenizer

    _write_tokenizer(Path(path), 512, chat_template=chat_template, tokens=tokens or ChatTokens())
    return AutoTokenizer.from_pretrained(str(path))


def build_tiny_model(path: Path, seed: int = 0, num_layers: int = 2, hidden_size: int = 64,
                     vocab_size: int = 512, max_position_embeddings: int = 4096, with_tools: bool = False,
                     chat_template: str | None = None, tokens: ChatTokens | None = None) -> Path:
    """Write config.json, model.safetensors and tokenizer files to path (if not there yet).
    with_tools: the tokenizer has TOOL_TOKENS as added tokens and a template that knows tools.
    chat_template and tokens: a model's own template (a real one, read from llama.cpp's sources
    by the tests) and the tokenizer's chat vocabulary it needs."""
    path = Path(path)
    if (path / "config.json").exists():
        return path
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    path.mkdir(parents=True, exist_ok=True)
    if chat_template is not None:
        tokens = tokens or ChatTokens()
        tok = _write_tokenizer(path, vocab_size, chat_template=chat_template, tokens=tokens)
    else:
        tokens = ChatTokens()
        tok = _write_tokenizer(path, vocab_size, TOOL_TOKENS, TOOLS_CHAT_TEMPLATE) if with_tools else \
            _write_tokenizer(path, vocab_size)

    num_heads, num_kv_heads = 4, 2
    head_dim = hidden_size // num_heads
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=tok.token_to_id(tokens.bos),
        eos_token_id=tok.token_to_id(tokens.eos), pad_token_id=tok.token_to_id(tokens.pad))
    config.save_pretrained(str(path))

    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float = 0.25) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    q_size, kv_size, inter = num_heads * head_dim, num_kv_heads * head_dim, 2 * hidden_size
    weights = {"model.embed_tokens.weight": rand(config.vocab_size, hidden_size, std=1.0),
               "model.norm.weight": torch.ones(hidden_size)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": torch.ones(hidden_size),
            p + "post_attention_layernorm.weight": torch.ones(hidden_size),
            p + "self_attn.q_proj.weight": rand(q_size, hidden_size),
            p + "self_attn.k_proj.weight": rand(kv_size, hidden_size),
            p + "self_attn.v_proj.weight": rand(kv_size, hidden_size),
            p + "self_attn.o_proj.weight": rand(hidden_size, q_size),
            p + "mlp.gate_proj.weight": rand(inter, hidden_size),
            p + "mlp.up_proj.weight": rand(inter, hidden_size),
            p + "mlp.down_proj.weight": rand(hidden_size, inter),
        }
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    eos = [config.eos_token_id] + [tok.token_to_id(t) for t in tokens.extra_eos]
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config.bos_token_id, "eos_token_id": eos if tokens.extra_eos else config.eos_token_id}))
    return path


def build_tiny_family_model(path: Path, config: Any, seed: int = 0, tokens: ChatTokens | None = None) -> Path:
    """Save a transformers model of `config`'s family (LlamaConfig, Qwen2Config, MistralConfig...)
    with random, well-separated weights and the tiny tokenizer (tokens: its chat vocabulary, the
    default's unless given). config.vocab_size must be at least the tokenizer's (about 500)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    tok = _write_tokenizer(path, 512, tokens=tokens)
    config.bos_token_id = config.pad_token_id = tok.token_to_id("<|endoftext|>")
    config.eos_token_id = tok.token_to_id("<|im_end|>")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # near 1, but not 1, so a misplaced norm weight shows
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            else:  # biases too: zero biases would hide a missing bias
                std = 1.0 if "embed_tokens" in name else 0.25
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    model.save_pretrained(str(path))
    return path


# A tiny random model of each family the README names (the parity and speculation tests).
_COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)


def family_config(family: str):
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    if family == "llama3-rope":
        return LlamaConfig(**_COMMON, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    if family == "qwen2-tied":
        return Qwen2Config(**_COMMON, tie_word_embeddings=True)
    if family == "qwen2-untied":
        return Qwen2Config(**_COMMON, tie_word_embeddings=False)
    if family == "qwen2-sliding":  # layer 0 full, layer 1 windowed
        return Qwen2Config(**_COMMON, tie_word_embeddings=False, use_sliding_window=True, sliding_window=8,
                           max_window_layers=1)
    if family == "mistral-window":  # a window far shorter than the prompts
        return MistralConfig(**_COMMON, tie_word_embeddings=False, sliding_window=8)
    if family == "qwen3":  # head_dim 32 != hidden / heads (16), as Qwen3's 128 is at every size
        return Qwen3Config(**{**_COMMON, "rms_norm_eps": 1e-6}, head_dim=32, tie_word_embeddings=True,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if family == "gemma3":  # layers: window, window, full; windows far shorter than the prompts
        return Gemma3TextConfig(**{**_COMMON, "rms_norm_eps": 1e-6, "num_hidden_layers": 3}, head_dim=32,
                                query_pre_attn_scalar=24, sliding_window=8, sliding_window_pattern=3,
                                rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                    "rope_theta": 1000000.0},
                                                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    # Qwen3-MoE: 8 experts of 32, 2 a token. "qwen3-moe": layers 1 and 3 sparse (decoder_sparse_step
    # 2), the k weights renormalised (the released checkpoints' norm_topk_prob); "qwen3-moe-unnormed":
    # layer 0 dense (mlp_only_layers), 1 and 2 sparse, the weights as the softmax gave them.
    moe = dict(**{**_COMMON, "rms_norm_eps": 1e-6}, head_dim=32, moe_intermediate_size=32, num_experts=8,
               num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if family == "qwen3-moe":
        return Qwen3MoeConfig(**{**moe, "num_hidden_layers": 4}, decoder_sparse_step=2, norm_topk_prob=True,
                              tie_word_embeddings=False)
    if family == "qwen3-moe-unnormed":
        return Qwen3MoeConfig(**{**moe, "num_hidden_layers": 3}, mlp_only_layers=[0], norm_topk_prob=False,
                              tie_word_embeddings=True)
    if family == "gpt-oss":  # layers: window, full, window, full; 8 experts, 2 a token; YaRN
        from transformers import GptOssConfig

        return GptOssConfig(**{**_COMMON, "num_hidden_layers": 4, "intermediate_size": 32}, head_dim=16,
                            num_local_experts=8, num_experts_per_tok=2, sliding_window=8, tie_word_embeddings=False,
                            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                                             "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                             "original_max_position_embeddings": 64})
    raise ValueError(family)


FAMILIES = ["llama3-rope", "qwen2-tied", "qwen2-untied", "qwen2-sliding", "mistral-window", "qwen3", "gemma3",
            "qwen3-moe", "qwen3-moe-unnormed"]
MOE_FAMILIES = ("qwen3-moe", "qwen3-moe-unnormed")  # the fused layers and the one-call decode step
# gpt-oss (family_config("gpt-oss")) is tested on its own (test_gpt_oss.py): int8 weights and the fused
# layers refuse it, which every FAMILIES test also runs.


def build_tiny_embedding_model(path: Path, pooling_mode: str = "lasttoken", normalize: bool = True,
                               family: str = "qwen3") -> Path:
    """A tiny random decoder embedder as sentence-transformers saves one (Qwen3-Embedding's layout:
    the base model's weights, modules.json, 1_Pooling/config.json and, when normalize, a Normalize
    module), built around build_tiny_family_model's model of `family`."""
    path = Path(path)
    if (path / "modules.json").exists():
        return path

    source = build_tiny_family_model(path.with_name(path.name + "-causal"), family_config(family))
    # Without a chat template: sentence-transformers 6 renders plain text through a tokenizer's chat
    # template when it has one, where an embedding server embeds the text's own tokens.
    (source / "chat_template.jinja").unlink(missing_ok=True)
    return save_sentence_transformer(source, path, pooling_mode, normalize)


def save_sentence_transformer(source: Path, path: Path, pooling_mode: str, normalize: bool) -> Path:
    """The transformers model in `source` saved at `path` as sentence-transformers saves an
    embedder: its Transformer, a Pooling module of pooling_mode, and Normalize when asked."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    transformer = Transformer(str(source))
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling_mode)]
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(path))
    return path


def build_tiny_sequence_classifier(path: Path, family: str = "qwen3", num_labels: int = 1, seed: int = 0) -> Path:
    """A tiny random decoder cross-encoder as transformers saves a *ForSequenceClassification of
    `family` (a converted reranker's layout: the base model's weights and a `score` projection of
    num_labels rows, no LM head), with the tiny tokenizer (no chat template)."""
    from transformers import AutoModelForSequenceClassification

    path = Path(path)
    if (path / "config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    tok = _write_tokenizer(path, 512)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config = family_config(family)
    config.num_labels = num_labels
    config.bos_token_id = config.pad_token_id = tok.token_to_id("<|endoftext|>")
    config.eos_token_id = tok.token_to_id("<|im_end|>")
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            else:  # the score rows scaled down, so a pair's logit lands where a sigmoid still tells them apart
                std = 1.0 if "embed_tokens" in name else 0.1 if name.startswith("score") else 0.25
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    model.save_pretrained(str(path))
    return path


# Qwen3-Reranker's label tokens, added to the tiny vocabulary (its BPE corpus has neither word).
RERANKER_TOKENS = ChatTokens(added=("yes", "no"))


def build_tiny_reranker_lm(path: Path, seed: int = 0) -> Path:
    """A tiny random Qwen3 causal LM whose vocabulary has the tokens "yes" and "no": the original
    Qwen3-Reranker's layout (a plain Qwen3ForCausalLM scored by those two logits)."""
    return build_tiny_family_model(path, family_config("qwen3"), seed, tokens=RERANKER_TOKENS)
