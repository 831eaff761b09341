"""A sparse mixture-of-experts MLP: a router picks k of E gated MLPs per token and sums their outputs.

One module serves the families' two routing recipes and their activations (MoeConfig says which):
- Qwen3-MoE: softmax over all E router logits in float32, the top k of those probabilities,
  renormalised over the k when `norm_topk_prob` is set, SwiGLU experts without biases;
- gpt-oss: the top k router logits (the router has a bias), softmax over those k, experts with
  biases and the clamped SwiGLU (gate clamped above at `limit`, up to [-limit, limit],
  gate * sigmoid(alpha * gate) * (up + 1)).

Experts are stored stacked: gate_up [E, 2I, H] (every expert's gate rows, then its up rows, as
the dense layers' gate_up_proj) and down [E, H, I], so a backend can swap `experts` for a kernel
that reads only the routed experts' rows. This torch form is the reference the kernels are tested
against: it adds each expert's weighted output in ascending expert order, as transformers does,
so float32 output matches `generate()`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.execution.models.expert_usage import ExpertUsage
from engine.execution.models.layers import Linear

ROUTINGS = ("softmax_topk", "topk_softmax")
ACTIVATIONS = ("silu", "swiglu_oai")


@dataclass(frozen=True, slots=True)
class MoeConfig:
    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int  # each expert's
    routing: str = "softmax_topk"  # one of ROUTINGS
    norm_topk_prob: bool = False  # softmax_topk: renormalise the k chosen probabilities to sum to 1
    activation: str = "silu"  # one of ACTIVATIONS
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(f"moe routing: {self.routing!r} is not one of {ROUTINGS}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"moe activation: {self.activation!r} is not one of {ACTIVATIONS}")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok: {self.num_experts_per_tok} must be in 1..{self.num_experts}")


def gated(gate_up: torch.Tensor, cfg: MoeConfig) -> torch.Tensor:
    """gate_up: [T, 2I] (gate halves first) -> [T, I], the experts' activation."""
    gate, up = gate_up.chunk(2, dim=-1)
    if cfg.activation == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=cfg.swiglu_limit)
    up = up.clamp(min=-cfg.swiglu_limit, max=cfg.swiglu_limit)
    return (up + 1) * (gate * torch.sigmoid(gate * cfg.swiglu_alpha))


# A stacked experts parameter -> each expert's projections in a checkpoint that names them one by
# one (Hugging Face's mlp.experts.N.gate_proj.weight ...), in the shards' order: expert e's gate
# (shard 2e) and up (2e + 1) rows of gate_up, its down (shard e).
_PER_EXPERT = {"gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


def per_expert_names(param: str, experts_prefix: str, num_experts: int) -> dict[str, str]:
    """Stacked parameter `param` (...experts.gate_up, .down, .gate_up_bias or .down_bias) -> its
    shard keys (param#shard) and each expert's checkpoint tensor under experts_prefix
    (model.layers.N.mlp.experts): expert e's gate and up for gate_up's shards 2e and 2e + 1, its
    down for down's shard e; weights or biases as the parameter is."""
    stacked = param.rpartition(".")[2]
    kind = "bias" if stacked.endswith("_bias") else "weight"
    projections = _PER_EXPERT.get(stacked.removesuffix("_bias"))
    if projections is None:
        raise ValueError(f"model: {param!r} is not a stacked experts parameter")
    return {f"{param}#{len(projections) * e + s}": f"{experts_prefix}.{e}.{proj}.{kind}"
            for e in range(num_experts) for s, proj in enumerate(projections)}


class Experts(nn.Module):
    """E gated MLPs stacked; forward runs each token through its k routed experts."""

    def __init__(self, cfg: MoeConfig, hidden_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        num_experts, size = cfg.num_experts, cfg.intermediate_size
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * size, hidden_size), requires_grad=False)
        self.down = nn.Parameter(torch.empty(num_experts, hidden_size, size), requires_grad=False)
        self.gate_up_bias = (nn.Parameter(torch.zeros(num_experts, 2 * size), requires_grad=False)
                             if cfg.expert_bias else None)
        self.down_bias = nn.Parameter(torch.zeros(num_experts, hidden_size), requires_grad=False) if cfg.expert_bias else None
        self.num_touched = 0  # distinct experts the last forward ran

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # x: [T, H]; expert_ids: [T, k] int64; weights: [T, k] in x's dtype -> [T, H]
        out = torch.zeros_like(x)
        k = expert_ids.shape[1]
        # The (token, slot) pairs grouped by expert, tokens ascending within each: one host sync a
        # layer (the group sizes), not one an expert.
        order = expert_ids.flatten().argsort(stable=True)  # [T * k]
        counts = torch.bincount(expert_ids.flatten(), minlength=self.cfg.num_experts).tolist()
        self.num_touched = sum(1 for count in counts if count)
        start = 0
        for expert, count in enumerate(counts):  # ascending, as transformers adds them
            if count == 0:
                continue
            pairs, start = order[start : start + count], start + count
            token, slot = pairs // k, pairs % k
            gate_up = F.linear(x[token], self.gate_up[expert],
                               None if self.gate_up_bias is None else self.gate_up_bias[expert])
            y = F.linear(gated(gate_up, self.cfg), self.down[expert],
                         None if self.down_bias is None else self.down_bias[expert])
            out.index_add_(0, token, (y * weights[token, slot, None]).to(x.dtype))
        return out


class SparseMoe(nn.Module):
    def __init__(self, cfg: MoeConfig, hidden_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = Linear(hidden_size, cfg.num_experts, bias=cfg.router_bias)
        self.experts = Experts(cfg, hidden_size)
        self.usage: ExpertUsage | None = None  # the model's count of experts run (track_expert_usage)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> expert ids [T, k] int64 and their weights [T, k] in x's dtype."""
        logits = self.router(x)  # [T, E] in x's dtype, as transformers computes them
        k = self.cfg.num_experts_per_tok
        if self.cfg.routing == "topk_softmax":
            top, ids = torch.topk(logits, k, dim=-1)
            return ids, torch.softmax(top, dim=-1)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, k, dim=-1)
        if self.cfg.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return ids, top.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        expert_ids, weights = self.route(x)
        out = self.experts(x, expert_ids, weights)
        if self.usage is not None:
            self.usage.add(self.experts.num_touched)  # an int the experts' grouping already holds
        return out


def track_expert_usage(model: nn.Module) -> ExpertUsage | None:
    """One ExpertUsage shared by the model's SparseMoe layers (after the backend swapped their
    experts: each kind reports `num_touched`); None for a dense model."""
    layers = [m for m in model.modules() if isinstance(m, SparseMoe)]
    if not layers:
        return None
    usage = ExpertUsage(len(layers))
    for layer in layers:
        layer.usage = usage
    return usage
