"""BERT-family encoders: the embedders most retrieval stacks run (bge, e5, all-MiniLM) and the
cross-encoders that rerank for them (BertForSequenceClassification).

Follows transformers' BertModel numerics in float32: word + learned absolute position + token
type embeddings, LayerNorm; then post-LayerNorm residual blocks (attention with q/k/v/output
biases, exact GELU MLP). Q/K/V are fused into one GEMM, and the model works on a step's packed
[num_tokens, hidden] rows as the decoders do.

Attention is bidirectional: every token of a prompt sees every other, so a prompt runs whole in
one step (the scheduler never splits it: ModelConfig.is_causal) and nothing is cached after it;
the K/V pool is not read or written. Each step's prompts attend within themselves
(PackedSequences): by the backend's kernel where it has one (the CPU's reads each prompt's q/k/v
in place from the fused QKV rows), else padded to the longest into one batched SDPA call.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.execution.attention import AttentionBackend, AttentionMetadata
from engine.execution.models.layers import Linear
from engine.execution.models.model_config import EncoderConfig, ModelConfig
from engine.processing.pooling_params import PoolingType

# The GELUs by F.gelu's `approximate`: up_proj.forward_gelu runs them (fused with the product on
# the CPU's panels); ReLU runs after the product.
_GELU_APPROXIMATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}
_ACTIVATIONS = (*_GELU_APPROXIMATIONS, "relu")
# A checkpoint module -> ours, after the layer prefix (encoder.layer.N.); q/k/v are shards of qkv_proj.
_LAYER_NAMES = {"attention.self.query": ("qkv_proj", 0), "attention.self.key": ("qkv_proj", 1),
                "attention.self.value": ("qkv_proj", 2), "attention.output.dense": ("o_proj", None),
                "attention.output.LayerNorm": ("attn_norm", None), "intermediate.dense": ("up_proj", None),
                "output.dense": ("down_proj", None), "output.LayerNorm": ("mlp_norm", None)}
_EMBEDDING_NAMES = {"embeddings.word_embeddings": "embed_tokens", "embeddings.position_embeddings":
                    "position_embeddings", "embeddings.token_type_embeddings": "token_type_embeddings",
                    "embeddings.LayerNorm": "embed_norm"}
# Tensors a checkpoint may carry that an encoder does not run: the position-id buffer older
# checkpoints saved, and the pre-training heads (masked LM, next sentence) of a base checkpoint.
_IGNORED_PREFIXES = ("embeddings.position_ids", "cls.")


class LayerNorm(nn.Module):
    """transformers' nn.LayerNorm, computed in float32 whatever the model's dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), x.shape[-1:], self.weight.float(), self.bias.float(), self.eps).to(x.dtype)


@dataclass(slots=True)
class PackedSequences:
    """A step's prompts, packed back to back in its rows, for attention.

    With the backend's kernel (backend set): query_starts [B + 1] int64 on the CPU, prompt b's
    rows [starts[b], starts[b + 1]). Else a padded batch: index [B, L] the packed row of each
    sequence's position (padding repeats row 0), L the longest prompt; key_mask [B, 1, 1, L]
    True on real keys; valid [B, L] True on real positions, row-major in packed order; all None
    with one sequence (no padding)."""

    index: torch.Tensor | None = None
    key_mask: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    backend: AttentionBackend | None = None
    query_starts: torch.Tensor | None = None

    @classmethod
    def of(cls, attn: AttentionMetadata, num_tokens: int, device: torch.device) -> PackedSequences:
        """The step's layout from its prefill metadata; RuntimeError when a row is not a whole
        prompt (a decode row, or a chunk after cached tokens: the scheduler never makes one for
        an encoder)."""
        metas = attn.prefill or []
        if attn.num_prefill_tokens != num_tokens or any(m.num_cached_tokens for m in metas):
            raise RuntimeError("an encoder runs whole prompts only: the step has decode rows or a chunk after "
                               "cached tokens")
        starts = torch.tensor([m.query_start for m in metas], dtype=torch.int64)
        backend = attn.backend
        if backend is not None and backend.has_bidirectional_kernel:
            return cls(backend=backend, query_starts=torch.cat([starts, starts.new_tensor([num_tokens])]))
        if len(metas) == 1:
            return cls()
        lengths = torch.tensor([m.query_len for m in metas], dtype=torch.int64)
        offsets = torch.arange(int(lengths.max()), dtype=torch.int64)
        valid = offsets.unsqueeze(0) < lengths.unsqueeze(1)  # [B, L]
        index = torch.where(valid, starts.unsqueeze(1) + offsets, 0)
        return cls(index.to(device), valid[:, None, None, :].to(device), valid.to(device))

    def attention(self, qkv: torch.Tensor, num_heads: int, scale: float) -> torch.Tensor:
        """qkv: [T, 3 * H * D], each row q | k | v -> [T, H, D]: each prompt's tokens attend to all
        of its own, none of another's."""
        if self.backend is not None:
            return self.backend.bidirectional(qkv, self.query_starts, num_heads, scale)
        num_tokens = qkv.shape[0]
        q, k, v = qkv.view(num_tokens, 3, num_heads, -1).unbind(1)
        if self.index is None:
            # [1, H, T, D] strided views: SDPA's flash kernel reads them (3-D input takes its math path)
            q, k, v = (t.unsqueeze(0).transpose(1, 2) for t in (q, k, v))
            return F.scaled_dot_product_attention(q, k, v, scale=scale)[0].transpose(0, 1)
        # [B, L, H, D] -> [B, H, L, D]; padded queries see real keys only, so no row is all -inf.
        # One call for the step: per prompt, unpadded, computes fewer pairs (2.4x fewer for lengths
        # spread over 64-512) but measured no faster on the CPU (flash kernel, head_dim 32), and
        # its strided copies back cost more.
        q, k, v = (t[self.index].transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.key_mask, scale=scale)
        return out.transpose(1, 2)[self.valid]  # [T, H, D] in packed order


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.num_heads, self.head_dim, self.scale = cfg.num_heads, cfg.head_dim, cfg.attn_scale
        self.qkv_proj = Linear(hidden, 3 * hidden, bias=True)
        self.o_proj = Linear(hidden, hidden, bias=True)
        self.attn_norm = LayerNorm(hidden, cfg.rms_norm_eps)
        self.up_proj = Linear(hidden, cfg.intermediate_size, bias=True)
        self.down_proj = Linear(cfg.intermediate_size, hidden, bias=True)
        self.mlp_norm = LayerNorm(hidden, cfg.rms_norm_eps)
        self.gelu_approximation = _GELU_APPROXIMATIONS.get(cfg.hidden_act)  # None: ReLU

    def forward(self, x: torch.Tensor, seqs: PackedSequences, rows: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]; with rows ([R] int64), only those rows' outputs: [R, hidden]
        (every row's keys and values still reach their attention)."""
        # post-LayerNorm: each block's output is added to its input, then normed
        num_tokens, hidden = x.shape
        # (x and h are this layer's own: forward_add_norm may write its result over them)
        # (forward_rounded: a bfloat16 encoder's attention reads the fused QKV in bfloat16, so a
        # backend may hand it over rounded)
        o = seqs.attention(self.qkv_proj.forward_rounded(x), self.num_heads, self.scale).reshape(num_tokens, hidden)
        if rows is not None:
            o, x = o[rows], x[rows]  # [R, hidden] each: the rows past attention that anyone reads
        h = self.o_proj.forward_add_norm(o, x, self.attn_norm)
        if self.gelu_approximation is not None:
            up = self.up_proj.forward_gelu(h, self.gelu_approximation)
        else:
            up = F.relu(self.up_proj(h))
        return self.down_proj.forward_add_norm(up, h, self.mlp_norm)


class BertModel(nn.Module):
    """The encoder alone (a sentence-transformers embedder's BertModel): forward -> the last
    layer's hidden states, which the pooler reads (CLS or mean, by the model's 1_Pooling)."""

    #: The step's token_type_ids (segment ids of a query / document pair) reach forward().
    uses_token_types = True
    #: Where a pooled request reads its vector unless told otherwise: BERT's [CLS] token.
    default_pooling_type = PoolingType.CLS
    #: forward() takes output_rows: the rows the caller reads, the last layer's work after
    #: attention run for those alone (a [CLS]-pooled step reads one row of each prompt).
    takes_output_rows = True
    #: The checkpoint's prefix of the encoder's tensors in a task model (bert.*); a base model's have none.
    BASE_PREFIX = "bert."
    #: A task head's checkpoint modules -> ours (none for the bare encoder, whose checkpoint may
    #: carry BERT's pooler unused).
    HEAD_NAMES: dict[str, str] = {}

    @classmethod
    def config_from_hf(cls, hf: Any) -> ModelConfig:
        if getattr(hf, "is_decoder", False) or getattr(hf, "add_cross_attention", False):
            raise ValueError(f"model: a {hf.model_type} decoder (is_decoder / add_cross_attention) is not supported; "
                             "only encoders")
        position_type = getattr(hf, "position_embedding_type", "absolute") or "absolute"
        if position_type != "absolute":
            raise ValueError(f"model: {hf.model_type} with position_embedding_type {position_type!r} is not "
                             "supported; only absolute")
        if hf.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"model: hidden_act {hf.hidden_act!r} is not supported; use one of {list(_ACTIVATIONS)}")
        num_heads, num_layers = hf.num_attention_heads, hf.num_hidden_layers
        encoder = EncoderConfig(type_vocab_size=hf.type_vocab_size, position_offset=cls._position_offset(hf))
        return ModelConfig(
            model_type=hf.model_type, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size, num_layers=num_layers, num_heads=num_heads,
            # rms_norm_eps: the norms' epsilon (LayerNorms here)
            num_kv_heads=num_heads, head_dim=hf.hidden_size // num_heads, rms_norm_eps=hf.layer_norm_eps,
            # the prompt's longest length: the table's rows past the offset
            max_position_embeddings=hf.max_position_embeddings - encoder.position_offset, tie_word_embeddings=False,
            qkv_bias=True, o_proj_bias=True, ropes=(), layer_ropes=(0,) * num_layers,
            sliding_windows=(None,) * num_layers, hidden_act=hf.hidden_act, encoder=encoder,
            num_labels=hf.num_labels if cls.HEAD_NAMES else 0)

    @classmethod
    def _position_offset(cls, hf: Any) -> int:
        """The first token's position id: 0 (BERT counts from the start)."""
        return 0

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        encoder = cfg.encoder
        # embed_tokens: every family's name for the word embeddings (the backends look it up)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings + encoder.position_offset, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(encoder.type_vocab_size, cfg.hidden_size)
        self.embed_norm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))
        self.position_offset = encoder.position_offset
        # An encoder has no LM head: the engine serves it for pooling only.
        self.has_lm_head = False
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                token_type_ids: torch.Tensor | None = None, output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T] (each prompt's from 0); token_type_ids: [T] int64 segment ids,
        None: all 0 (a single text). -> hidden: [T, hidden]. output_rows: [R] int64, the only rows
        of hidden the caller reads (the others then hold the layer before the last's states). kv_caches
        are not used: nothing of a prompt is kept after its step."""
        seqs = PackedSequences.of(attn, input_ids.shape[0], input_ids.device)
        x = self.embed_tokens(input_ids) + self.position_embeddings(positions + self.position_offset)
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        x = self.embed_norm(x)
        *layers, last = self.layers
        for layer in layers:
            x = layer(x, seqs)
        if output_rows is None:
            return last(x, seqs)
        # The last layer's products after attention for the read rows alone: for [CLS] pooling of
        # prompts of ~300 tokens, 3/4 of that layer's multiply-adds skipped.
        return x.index_copy_(0, output_rows, last(x, seqs, output_rows))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{self.config.model_type} is an encoder: it has no LM head to sample from")

    # ---- weights ---------------------------------------------------------------------------

    def _expected_weights(self) -> dict[str, str]:
        """Every tensor the checkpoint must hold: our key (param, or param#shard for q/k/v's shards
        of qkv_proj) -> its name in the checkpoint, without the task model's prefix (the form the
        decoders and the GGUF loader key them by)."""
        expected: dict[str, str] = {}
        for hf, ours in _EMBEDDING_NAMES.items():
            kinds = ("weight", "bias") if ours == "embed_norm" else ("weight",)
            expected |= {f"{ours}.{kind}": f"{hf}.{kind}" for kind in kinds}
        for i in range(self.config.num_layers):
            for hf, (ours, shard) in _LAYER_NAMES.items():
                for kind in ("weight", "bias"):
                    key = f"layers.{i}.{ours}.{kind}" + ("" if shard is None else f"#{shard}")
                    expected[key] = f"encoder.layer.{i}.{hf}.{kind}"
        for hf, ours in self.HEAD_NAMES.items():
            expected |= {f"{ours}.{kind}": f"{hf}.{kind}" for kind in ("weight", "bias")}
        return expected

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's name as _expected_weights spells it (the task model's prefix
        off, TF-era gamma/beta as weight/bias); None for one this model does not run."""
        name = name.removeprefix(self.BASE_PREFIX)
        if name.startswith(_IGNORED_PREFIXES) or (name.startswith("pooler.") and "pooler.dense" not in self.HEAD_NAMES):
            return None
        for old, new in ((".gamma", ".weight"), (".beta", ".bias")):
            if name.endswith(old) and "LayerNorm" in name:
                name = name.removesuffix(old) + new
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors, fusing q/k/v. ValueError naming the tensor when one is unknown,
        repeated, of the wrong shape, or missing."""
        params = dict(self.named_parameters())
        key_of = {hf: key for key, hf in self._expected_weights().items()}  # checkpoint name -> our key
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = self.checkpoint_name(hf_name)
            if name is None:
                continue
            if name not in key_of:
                raise ValueError(f"unexpected weight {hf_name!r} in checkpoint")
            if name in loaded:
                raise ValueError(f"weight {hf_name!r} appears twice in the checkpoint")
            param_name, _, shard = key_of[name].partition("#")
            dest = params[param_name].data
            if shard:
                size = dest.shape[0] // 3
                dest = dest[int(shard) * size : (int(shard) + 1) * size]
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.add(name)
        missing = [name for name in key_of if name not in loaded]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:5])}{more}")


class BertForSequenceClassification(BertModel):
    """A cross-encoder (ms-marco-MiniLM's layout): the encoder over a (query, document) pair told
    apart by token types, then score_head on its [CLS] state."""

    # BERT's pooler sits inside the encoder's prefix (bert.pooler), the classifier beside it
    HEAD_NAMES = {"pooler.dense": "pooler", "classifier": "classifier"}

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.pooler = Linear(cfg.hidden_size, cfg.hidden_size, bias=True)
        self.classifier = Linear(cfg.hidden_size, cfg.num_labels, bias=True)
        for p in self.parameters():
            p.requires_grad_(False)

    def score_head(self, pooled: torch.Tensor) -> torch.Tensor:
        """pooled: [n, hidden] the [CLS] states -> [n, num_labels] float32 raw logits: a dense layer
        and tanh (BERT's pooler), then the classifier (the caller applies a sigmoid or softmax)."""
        x = torch.tanh(self.pooler(pooled.to(self.embed_tokens.weight.dtype)))
        return self.classifier.forward_float(x)
