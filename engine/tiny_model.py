"""A tiny random-weight Llama with a real byte-level BPE tokenizer, built offline in seconds.

Unit tests and smoke benchmarks run on it so the suite stays fast and needs no download.
Weights are scaled up from the usual init so logits are well separated: greedy choices are
then stable against float rounding, and token-for-token comparisons stay meaningful.
"""
from __future__ import annotations

import json
from pathlib import Path

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


def build_tiny_model(path: Path, seed: int = 0, num_layers: int = 2, hidden_size: int = 64,
                     vocab_size: int = 512, max_position_embeddings: int = 4096) -> Path:
    """Write config.json, model.safetensors and tokenizer files to path (if not there yet)."""
    path = Path(path)
    if (path / "config.json").exists():
        return path
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=_SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(str(path))

    num_heads, num_kv_heads = 4, 2
    head_dim = hidden_size // num_heads
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=tok.token_to_id("<|endoftext|>"),
        eos_token_id=tok.token_to_id("<|im_end|>"), pad_token_id=tok.token_to_id("<|endoftext|>"))
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
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}))
    return path
