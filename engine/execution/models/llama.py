"""Llama-family decoder (Llama 2/3, SmolLM2; Mistral, Qwen2/3 and Gemma 3 subclass it) over a paged KV cache.

Follows transformers' LlamaForCausalLM numerics (RMSNorm in fp32, rotate-half RoPE, SiLU
gated MLP) so greedy output matches `generate()` token for token, with two changes for
speed: Q/K/V and gate/up projections are fused into one GEMM each, and the whole model
works on a packed [num_tokens, hidden] batch with no padding. The model owns how checkpoint
tensors map onto those fused weights (`load_weights`), and refuses a checkpoint with a tensor
missing, unknown or of the wrong shape.

The families differ by ModelConfig fields, not by forks of this code: per-head query/key norms
(Qwen3, Gemma 3), Gemma's norms of the attention's and the MLP's outputs, GeGLU, scaled
embeddings, a softmax scale of its own, and per-layer windows and ropes.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.execution.attention import AttentionMetadata, attention
from engine.execution.models.layers import GatedActivation, Linear, RMSNorm, Rotation
from engine.execution.models.model_config import ModelConfig
from engine.execution.models.moe import SparseMoe
from engine.processing.pooling_params import PoolingType

# Checkpoint projection -> (our fused projection, its shard index).
_STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_HF_MODULE = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp",
              "q_norm": "self_attn", "k_norm": "self_attn"}


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.attn_scale
        self.sliding_window = cfg.sliding_windows[layer_index]
        self.rope_index = cfg.layer_ropes[layer_index]
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # The MLP's input norm (Llama's name for it; Gemma calls it pre_feedforward_layernorm).
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        # Gemma: the attention's and the MLP's outputs normed before their residual adds.
        self.attn_output_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.sandwich_norms else None
        self.mlp_output_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.sandwich_norms else None
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        # gpt-oss: each head's sink logit, in the softmax's denominator (engine/execution/attention.py).
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads), requires_grad=False) if cfg.attn_sinks else None
        # A mixture-of-experts layer (cfg.is_moe_layer) has the sparse MLP in place of the dense one.
        self.moe = SparseMoe(cfg.moe, cfg.hidden_size) if cfg.is_moe_layer(layer_index) else None
        if self.moe is None:
            self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
            self.gated_act = GatedActivation(cfg.hidden_act, cfg.intermediate_size)
            self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)
        self.rotation = Rotation()
        self.intermediate_size = cfg.intermediate_size
        self.hidden_act = cfg.hidden_act
        self.eps = cfg.rms_norm_eps

    @property
    def projections(self) -> tuple[Linear, ...]:
        """QKV, output, gate/up and down: the order a decode step reads them (a MoE layer: QKV,
        output and its router; its experts are the `moe.experts` module's)."""
        if self.moe is not None:
            return self.qkv_proj, self.o_proj, self.moe.router
        return self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, hidden]; cos, sin: [T, 1, head_dim] -> [T, hidden]; with rows ([R] int64), only
        those rows past attention: [R, hidden] (every row's K and V still written and attended)."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(self.input_layernorm(x))
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotation.rotate_and_cache(q, k, v, cos, sin, k_cache, v_cache, attn.slot_mapping)
        o = attention(q, k, v, k_cache, v_cache, attn, self.scale, self.sliding_window, self.sinks)
        o = o.reshape(num_tokens, self.q_size)
        if rows is not None:
            o, x = o[rows], x[rows]
            if rows.numel() == 0:  # a chunk that samples nothing: its keys and values were all it had to give
                return x
        o = self.o_proj(o)
        h, normed = self.post_attention_layernorm.add_and_norm(
            x, o if self.attn_output_norm is None else self.attn_output_norm(o))
        m = self.moe(normed) if self.moe is not None else self.down_proj(self.gated_act(self.gate_up_proj(normed)))
        return h + (m if self.mlp_output_norm is None else self.mlp_output_norm(m))


class LlamaForCausalLM(nn.Module):
    #: forward() takes output_rows: the rows the caller reads (sampled, pooled), the last layer's
    #: products past attention run for those alone.
    takes_output_rows = True
    #: A layer's norm (or other part beyond Llama's) -> the checkpoint's name for it, where they
    #: differ (Gemma's norms, gpt-oss's sinks).
    PART_NAMES: dict[str, str] = {}
    #: Added to every norm weight at load: Gemma's norms scale by (1 + weight), which the
    #: float32 weights hold once added (the same rounding as transformers' per-step sum).
    NORM_WEIGHT_OFFSET = 0.0
    #: Where score_head reads: the last token's state, as transformers' *ForSequenceClassification
    #: of a decoder pools (its last non-padding token).
    score_pooling_type = PoolingType.LAST

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
        # A sequence classifier's head (a plain nn.Linear: the backends pack only the Linear
        # projections, and [num_labels, hidden] is too small to gain from it).
        self.score = nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False) if cfg.num_labels else None
        # cos / sin of every position per rope, made on first use on the device the forward runs
        # on: a plain attribute, not a buffer, so model.to(bfloat16) leaves it (and the
        # frequencies it is made from) in float32.
        self.rope_tables: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        # False for a base model's checkpoint without an untied LM head (sentence-transformers saves
        # Qwen3-Embedding-8B so): it embeds, it cannot generate (its lm_head is zeros).
        self.has_lm_head = not cfg.num_labels  # a classifier's checkpoint holds its score head instead
        for p in self.parameters():
            p.requires_grad_(False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] -> [T, hidden] in the embedding's dtype, scaled where the family scales
        it (by the scale rounded to that dtype, as transformers does)."""
        x = self.embed_tokens(input_ids)
        if self.config.embed_scale is not None:
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        return x

    def rope(self, positions: torch.Tensor, index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> cos, sin: [T, head_dim] float32 of rope `index`, rows of tables made once.

        Why tables: computing them per step took about 15 small ops, each slow after a batch-1
        decode's weight stream left the caches cold. Why float32: frequencies rounded to
        bfloat16 (as a buffer is by model.to) are up to 0.4 % off, so the angles drift from the
        checkpoint's, by radians at a thousand positions in absolute terms. (RoPE's scores see
        relative angles: SmolLM2-135M's perplexity did not move.)"""
        cos_table, sin_table = self.rope_tables_on(positions.device, index)
        cos, sin = cos_table[positions], sin_table[positions]  # [T, head_dim / 2]
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)

    def rope_tables_on(self, device: torch.device, index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of every position for rope `index`: [max_positions, head_dim / 2] float32 each,
        made on first use. Half a head: a rotation's two halves share their angles, and a full
        table of gpt-oss's 131,072 positions held 64 MiB resident for nothing."""
        if self.rope_tables is None or self.rope_tables[0][0].device != device:
            cfg = self.config
            steps = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
            self.rope_tables = []
            for rope in cfg.ropes:
                freqs = steps.unsqueeze(1) * rope.inv_freq.float().unsqueeze(0)  # [max_positions, head_dim / 2]
                self.rope_tables.append(((freqs.cos() * rope.scale).to(device), (freqs.sin() * rope.scale).to(device)))
        return self.rope_tables[index]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden: [T, hidden]. output_rows ([R] int64): the only rows
        of hidden anyone reads; the last layer past attention runs for them alone, the other rows
        left with the layer before's states."""
        x = self.embed(input_ids)
        ropes = [tuple(t.to(x.dtype).unsqueeze(1) for t in self.rope(positions, i))  # [T, 1, head_dim] each
                 for i in range(len(self.config.ropes))]
        last = len(self.layers) - 1
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            cos, sin = ropes[layer.rope_index]
            if i == last and output_rows is not None:
                x.index_copy_(0, output_rows, layer(x, cos, sin, attn.for_layer(i), k_cache, v_cache, output_rows))
            else:
                x = layer(x, cos, sin, attn.for_layer(i), k_cache, v_cache)  # its KV-cache group's tables
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> logits: [N, vocab] in fp32 for the sampler
        return self.lm_head.forward_float(hidden)

    def score_head(self, pooled: torch.Tensor) -> torch.Tensor:
        """pooled: [n, hidden] final-normed states of each request's last token -> raw logits
        [n, num_labels] float32: the classifier's `score` projection, or the LM head's logits of
        config.score_token_ids (of two, the second's minus the first's: its sigmoid is the
        softmax over the pair's probability of the second, as Qwen3-Reranker's card computes)."""
        if self.score is not None:
            return F.linear(pooled.to(self.score.weight.dtype), self.score.weight).float()
        token_ids = self.config.score_token_ids
        if not token_ids:
            raise RuntimeError("this model has no score head (not a sequence classifier, and no score tokens)")
        logits = self.compute_logits(pooled)  # [n, vocab] float32
        chosen = logits[:, list(token_ids)]  # [n, len(token_ids)]
        return chosen[:, 1:] - chosen[:, :1] if len(token_ids) == 2 else chosen

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
            if name == "lm_head.weight" and self.score is not None:
                continue  # a classifier's checkpoint has its score head instead
            if parts[0] != "layers":
                expected[name] = f"model.{name}" if name not in ("lm_head.weight", "score.weight") else name
                continue
            layer, module, kind = parts[1], parts[2], parts[-1]
            if module == "moe":
                expected |= self._moe_weights(name, int(layer))
                continue
            prefix = f"model.layers.{layer}.{_HF_MODULE.get(module)}"
            if module in ("qkv_proj", "gate_up_proj"):
                for hf_proj, (fused, shard) in _STACKED.items():
                    if fused == module:
                        expected[f"{name}#{shard}"] = f"{prefix}.{hf_proj}.{kind}"
            elif module in _HF_MODULE:
                expected[name] = f"{prefix}.{module}.{kind}"
            else:  # norms, and what a family's layer holds beyond Llama's (sinks, a sparse MLP's parts)
                expected[name] = ".".join(["model.layers", layer, self.PART_NAMES.get(module, module), *parts[3:]])
        return expected

    def _moe_weights(self, name: str, layer: int) -> dict[str, str]:
        """A MoE layer's parameter `name` (layers.N.moe.router.weight, layers.N.moe.experts.gate_up,
        ...) -> its checkpoint tensors, keyed as _expected_weights keys them (an expert's part of a
        stacked tensor as a shard: see _shard). By default the checkpoint holds them under our own
        names (a family whose layout differs, as gpt-oss's, converts it in load_weights); Qwen3-MoE
        names each expert's tensors."""
        return {name: f"model.layers.{layer}.{name.split('.', 2)[2]}"}

    def _shard(self, param_name: str, dest: torch.Tensor, shard: int) -> torch.Tensor:
        """The slice of parameter `param_name` (its data: dest) that checkpoint shard `shard` fills:
        q, k, v or gate, up of a fused projection; of stacked experts, expert e's gate rows (shard
        2e) and up rows (2e + 1) of gate_up [E, 2I, H], its down [H, I] (shard e) of down [E, H, I],
        and their biases' likewise (gate_up_bias [E, 2I], down_bias [E, H])."""
        if param_name.endswith(("experts.gate_up", "experts.gate_up_bias")):
            num_experts, rows, *cols = dest.shape
            return dest.view(2 * num_experts, rows // 2, *cols)[shard]
        if param_name.endswith(("experts.down", "experts.down_bias")):
            return dest[shard]
        sizes = self._shard_sizes(param_name.split(".")[2])
        start = sum(sizes[:shard])
        return dest[start : start + sizes[shard]]

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's name as _expected_weights spells it; None for a tensor this model
        ignores (Gemma 3's vision tower in a multimodal checkpoint)."""
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors, fusing q/k/v and gate/up on the way. Raises ValueError naming
        the tensor when one is unknown, repeated, of the wrong shape, or missing."""
        params = dict(self.named_parameters())
        expected = self._expected_weights()
        key_of = {hf: key for key, hf in expected.items()}
        loaded: set[str] = set()
        is_base_model = True  # every name without the causal LM's "model." (and no lm_head)
        for hf_name, tensor in weights:
            name = self.checkpoint_name(hf_name)
            if name is not None and (name.startswith("model.") or name == "lm_head.weight"):
                is_base_model = False
            if name is None or "rotary_emb" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            key = key_of.get(name)
            if key is None and not name.startswith("model."):
                # A base model's checkpoint (sentence-transformers saves Qwen3-Embedding's as Qwen3Model: no "model.")
                key = key_of.get(f"model.{name}")
            if key is None:
                raise ValueError(f"unexpected weight {hf_name!r} in checkpoint")
            param_name, _, shard = key.partition("#")
            dest = params[param_name].data
            if shard:
                dest = self._shard(param_name, dest, int(shard))
            if key in loaded:
                raise ValueError(f"weight {hf_name!r} appears twice in the checkpoint")
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            if self.NORM_WEIGHT_OFFSET and param_name.endswith("norm.weight"):
                tensor = tensor.float() + self.NORM_WEIGHT_OFFSET
            dest.copy_(tensor)
            loaded.add(key)
        missing = [hf for key, hf in expected.items() if key not in loaded]
        if self.score is not None and not self.config.tie_word_embeddings:
            self.lm_head.weight.data.zero_()  # not in the checkpoint: never read, but not left as noise
        if missing == ["lm_head.weight"] and is_base_model:
            self.has_lm_head = False
            self.lm_head.weight.data.zero_()
            missing = []
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:5])}{more}")
