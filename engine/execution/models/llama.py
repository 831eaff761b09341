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
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.execution.attention import AttentionMetadata, attention, write_kv
from engine.execution.models.layers import Linear, RMSNorm, rotate_half
from engine.execution.models.model_config import ModelConfig
from engine.execution.models.packed_weight import place_on_huge_pages

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
        self.norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None  # float32 copies for the C++ layer

    @property
    def projections(self) -> tuple[Linear, Linear, Linear, Linear]:
        """QKV, output, gate/up and down: the order the C++ layer takes them and a decode step reads them."""
        return self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj

    def fused_weights(self, kernels: ModuleType) -> Any:
        """This layer as kernels.decode_layers takes it (norm_weights and the panels set first)."""
        return kernels.DecodeLayerWeights(*self.norm_weights, *(p.panels.as_args() for p in self.projections),
                                          self.sliding_window or 0)

    def forward_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, kernels: ModuleType, isa: int) -> None:
        """The layer in C++ over the panel-packed weights, for steps of a few tokens.
        x: [T, hidden] float32, updated in place; cos, sin: [T, head_dim] float32.

        A decode-only step is one call. A step with prefill rows is two, around the step's
        `attention` (a chunk's queries share every key they read; per-row decode attention
        would walk the context once per query). The small chunks a time-budgeted step carries
        beside running streams then cost their GEMM rows, not the ~150 dispatched ops per layer
        of the torch path, which alone take about as long as a whole decode step."""
        qkv, o, gate_up, down = (p.panels.as_args() for p in self.projections)
        window = self.sliding_window or 0
        num_prefill = attn.num_prefill_tokens
        if num_prefill == 0:
            kernels.decode_layer(x, cos, sin, *self.norm_weights, qkv, o, gate_up, down, k_cache, v_cache,
                                 attn.slot_mapping, attn.block_tables, attn.context_lens, self.num_heads,
                                 attn.block_size, self.eps, self.scale, window, isa)
            return
        num_tokens = x.shape[0]
        qkv_out = kernels.layer_attention_inputs(x, cos, sin, self.norm_weights[0], qkv, k_cache, v_cache,
                                                 attn.slot_mapping, self.num_heads, self.eps, isa)  # [T, q | k | v]
        q, k, v = qkv_out.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = attention(q, k, v, k_cache, v_cache, attn, self.scale, self.sliding_window)  # [T, H, D] float32
        kernels.layer_attention_outputs(x, out.reshape(num_tokens, self.q_size), self.norm_weights[1], o, gate_up,
                                        down, self.eps, isa)

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
        self.fused_kernels: ModuleType | None = None  # set when every layer has panels (pack_weights)
        self.fused_isa = 0
        self.decode_weights: list[Any] = []  # DecoderLayer.fused_weights per layer, with the panels
        self.final_norm_weight: torch.Tensor | None = None  # [hidden] float32 for the decoder
        self.decoder: Any = None  # kernels.DecodeModel, once bind_decode has the caches

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> cos, sin: [T, head_dim] float32, rows of tables made once.

        Why tables: computing them per step took about 15 small ops, which after a batch-1
        decode's weight stream (caches cold) cost ~2 % of a bf16 step (1.018x in an A/B). Why float32:
        frequencies rounded to bfloat16 (as a buffer is by model.to) are up to 0.4 % off, so
        the angles drift from the checkpoint's, by radians at a thousand positions in absolute
        terms. (RoPE's scores see relative angles, and SmolLM2-135M's perplexity on the
        repository's 971-token text did not move: 18.255 before, 18.256 after.)"""
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
        if attn.is_fused:
            return self._forward_fused(x, positions, attn, kv_caches)
        cos, sin = (t.to(x.dtype).unsqueeze(1) for t in self.rope(positions))  # [T, 1, head_dim]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, attn, k_cache, v_cache)
        return self.norm(x)

    def _forward_fused(self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        # x: [T, hidden] -> hidden: [T, hidden]; the residual stream stays float32 across layers
        dtype = x.dtype
        x = x.float().contiguous()
        cos, sin = self.rope(positions)  # [T, head_dim]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            layer.forward_fused(x, cos, sin, attn, k_cache, v_cache, self.fused_kernels, self.fused_isa)
        return self.norm(x).to(dtype)

    def bind_decode(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int) -> None:
        """Bind what every decode-only step shares for `decode_logits` (after pack_weights with
        panels): the weights, the RoPE tables, the caches, not converted from Python on every call
        (this, with the sequences' lists as the step's inputs, took a batch-1 bf16 step's host
        part from 0.59 to 0.40 ms on a 2-core Zen 4)."""
        cos_table, sin_table = self.rope_tables_on(self.final_norm_weight.device)
        first = self.layers[0]  # the layers share heads, eps and scale (and the final norm's eps)
        self.decoder = self.fused_kernels.DecodeModel(
            self.embed_tokens.weight, cos_table, sin_table, self.decode_weights, kv_caches, self.final_norm_weight,
            self.lm_head.panels.as_args(), first.num_heads, block_size, first.eps, first.scale, self.fused_isa)

    def decode_logits(self, token_ids: list[int], block_tables: list[list[int]], context_lens: list[int],
                      with_argmax: bool = False) -> tuple[torch.Tensor, list[int] | None]:
        """A decode-only step with the fused kernels (after bind_decode), from token ids to
        logits in one C++ call: per sequence its last token, its block table and its context
        length (the token's position + 1), as the sequences hold them -> logits [B, vocab]
        float32 and, with_argmax, each row's first argmax (torch.argmax's rule) as a list, else None.

        One call, not the input tensors, embedding, RoPE rows, layers and LM head as a dozen
        torch and numpy ops: after a batch-1 step's weight stream every such op finds the caches
        cold, and they took about 0.4 ms of a 10 ms bf16 step on a 2-core Zen 4."""
        return self.decoder.step(token_ids, block_tables, context_lens, with_argmax)

    def take_decode_part_seconds(self) -> dict[str, float] | None:
        """The fused decode steps' wall seconds by kind of part (qkv, attention, o_proj, gate_up,
        silu, down, lm_head, argmax, outside) and their count ('steps'), summed since the last
        call, which this zeroes; None without the fused decode step."""
        return None if self.decoder is None else dict(self.decoder.take_part_seconds())

    def pack_weights(self, onednn: bool, panel_dtype: torch.dtype | None, kernels: ModuleType | None, isa: int,
                     max_panel_rows: int, huge_pages: bool = False) -> None:
        """Pack every projection once, after loading (CPU): for oneDNN (prefill, large batches)
        and/or as panels of `panel_dtype` for the C++ small-batch kernels (steps of up to
        `max_panel_rows` tokens; every step when they are the only copy, as in int8). With
        panels, such steps run each layer as C++ calls (`forward_fused`); panels need `kernels`.
        `huge_pages`: the panels share one region on 2 MiB pages."""
        if panel_dtype is not None and kernels is None:
            raise ValueError("panel-packed weights need the C++ CPU kernels")
        for module in self.modules():
            if not isinstance(module, Linear):
                continue
            tied = module is self.lm_head and self.config.tie_word_embeddings  # the embedding still needs it
            if panel_dtype is not None:
                module.pack_panels(panel_dtype, kernels, isa, max_panel_rows)
            if onednn:
                module.pack(drop_weight=not tied)
            elif panel_dtype is not None and not tied:
                module.drop_weight()
        if panel_dtype is not None:
            if huge_pages:  # before decode_weights takes the panels' addresses
                place_on_huge_pages([m.panels for m in self.modules() if isinstance(m, Linear) and m.panels is not None])
            for layer in self.layers:
                layer.norm_weights = (layer.input_layernorm.weight.float().contiguous(),
                                      layer.post_attention_layernorm.weight.float().contiguous())
            self.decode_weights = [layer.fused_weights(kernels) for layer in self.layers]
            self.final_norm_weight = self.norm.weight.float().contiguous()
            self.fused_kernels, self.fused_isa = kernels, isa

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
