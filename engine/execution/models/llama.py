"""Llama-family decoder (Llama 2/3, SmolLM2; Mistral and Qwen2 subclass it) over a paged KV cache.

Follows transformers' LlamaForCausalLM numerics (RMSNorm in fp32, rotate-half RoPE, SiLU
gated MLP) so greedy output matches `generate()` token for token, with two changes for
speed: Q/K/V and gate/up projections are fused into one GEMM each, and the whole model
works on a packed [num_tokens, hidden] batch with no padding. The model owns how checkpoint
tensors map onto those fused weights (`load_weights`), and refuses a checkpoint with a tensor
missing, unknown or of the wrong shape.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.execution.attention import AttentionMetadata, attention, write_kv
from engine.execution.models.layers import Linear, RMSNorm, rotate_half
from engine.execution.models.model_config import ModelConfig

# Checkpoint projection -> (our fused projection, its shard index).
_STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_HF_MODULE = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.sliding_window = cfg.sliding_windows[layer_index]
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)
        self.intermediate_size = cfg.intermediate_size
        self.eps = cfg.rms_norm_eps

    @property
    def projections(self) -> tuple[Linear, Linear, Linear, Linear]:
        """QKV, output, gate/up and down: the order a decode step reads them."""
        return self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]; cos, sin: [T, 1, head_dim]
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(self.input_layernorm(x))
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        write_kv(k_cache, v_cache, k, v, attn.slot_mapping)
        o = attention(q, k, v, k_cache, v_cache, attn, self.scale, self.sliding_window)
        h = x + self.o_proj(o.reshape(num_tokens, self.q_size))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(h)).split(self.intermediate_size, dim=-1)
        return h + self.down_proj(F.silu(gate) * up)


class LlamaForCausalLM(nn.Module):
    @classmethod
    def config_from_hf(cls, hf: Any) -> ModelConfig:
        # Llama puts attention_bias on q/k/v and o alike.
        return ModelConfig.from_hf(hf, o_proj_bias=bool(getattr(hf, "attention_bias", False)))

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # cos / sin of every position, made on first use on the device the forward runs on: a
        # plain attribute, not a buffer, so model.to(bfloat16) leaves it (and the frequencies it
        # is made from) in float32.
        self.rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None
        for p in self.parameters():
            p.requires_grad_(False)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> cos, sin: [T, head_dim] float32, rows of tables made once.

        Why tables: computing them per step took about 15 small ops, each slow after a batch-1
        decode's weight stream left the caches cold. Why float32: frequencies rounded to
        bfloat16 (as a buffer is by model.to) are up to 0.4 % off, so the angles drift from the
        checkpoint's, by radians at a thousand positions in absolute terms. (RoPE's scores see
        relative angles: SmolLM2-135M's perplexity did not move.)"""
        cos_table, sin_table = self.rope_tables_on(positions.device)
        return cos_table[positions], sin_table[positions]

    def rope_tables_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of every position: [max_positions, head_dim] float32 each, made on first use."""
        if self.rope_tables is None or self.rope_tables[0].device != device:
            cfg = self.config
            steps = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
            freqs = steps.unsqueeze(1) * cfg.inv_freq.float().unsqueeze(0)  # [max_positions, head_dim / 2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
            self.rope_tables = ((emb.cos() * cfg.rope_scale).to(device),
                                (emb.sin() * cfg.rope_scale).to(device))
        return self.rope_tables

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden: [T, hidden]
        x = self.embed_tokens(input_ids)
        cos, sin = (t.to(x.dtype).unsqueeze(1) for t in self.rope(positions))  # [T, 1, head_dim]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, attn, k_cache, v_cache)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> logits: [N, vocab] in fp32 for the sampler
        return self.lm_head.forward_float(hidden)

    def _shard_sizes(self, fused: str) -> list[int]:
        cfg = self.config
        if fused == "qkv_proj":
            kv = cfg.num_kv_heads * cfg.head_dim
            return [cfg.num_heads * cfg.head_dim, kv, kv]
        return [cfg.intermediate_size, cfg.intermediate_size]

    def _expected_weights(self) -> dict[str, str]:
        """Every tensor the checkpoint must hold: our key (param, or param#shard) -> its HF name."""
        expected = {}
        for name in dict(self.named_parameters()):  # a tied lm_head is not listed again
            parts = name.split(".")
            if parts[0] != "layers":
                expected[name] = f"model.{name}" if name != "lm_head.weight" else name
                continue
            layer, module, kind = parts[1], parts[2], parts[3]
            prefix = f"model.layers.{layer}.{_HF_MODULE.get(module)}"
            if module in ("qkv_proj", "gate_up_proj"):
                for hf_proj, (fused, shard) in _STACKED.items():
                    if fused == module:
                        expected[f"{name}#{shard}"] = f"{prefix}.{hf_proj}.{kind}"
            elif module in _HF_MODULE:
                expected[name] = f"{prefix}.{module}.{kind}"
            else:
                expected[name] = f"model.{name}"
        return expected

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors, fusing q/k/v and gate/up on the way. Raises ValueError naming
        the tensor when one is unknown, repeated, of the wrong shape, or missing."""
        params = dict(self.named_parameters())
        expected = self._expected_weights()
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            parts = name.split(".")
            key, dest = name, None
            if len(parts) == 5 and parts[0] == "layers" and parts[3] in _STACKED:
                fused, shard = _STACKED[parts[3]]
                param_name = f"layers.{parts[1]}.{fused}.{parts[4]}"
                key = f"{param_name}#{shard}"
                if param_name in params:
                    sizes = self._shard_sizes(fused)
                    start = sum(sizes[:shard])
                    dest = params[param_name].data[start : start + sizes[shard]]
            else:
                if len(parts) == 5 and parts[0] == "layers" and parts[3] in ("o_proj", "down_proj"):
                    key = f"layers.{parts[1]}.{parts[3]}.{parts[4]}"
                if key in params:
                    dest = params[key].data
            if dest is None or key not in expected:
                raise ValueError(f"unexpected weight {hf_name!r} in checkpoint")
            if key in loaded:
                raise ValueError(f"weight {hf_name!r} appears twice in the checkpoint")
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.add(key)
        missing = [hf for key, hf in expected.items() if key not in loaded]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:5])}{more}")
