"""The sparse MoE module against transformers' own blocks: Qwen3-MoE's (softmax over all experts,
then top k, renormalised or not) and gpt-oss's (top k logits, softmax over them, clamped SwiGLU,
biases; its gate/up columns interleaved in the checkpoint, split into halves here)."""
from __future__ import annotations

import pytest
import torch

from engine.execution.models.moe import MoeConfig, SparseMoe

transformers = pytest.importorskip("transformers")


def _random_(module: torch.nn.Module, std: float) -> None:
    gen = torch.Generator().manual_seed(0)
    for p in module.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * std)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_block(norm_topk_prob: bool) -> None:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hf = transformers.Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8,
                                     num_experts_per_tok=3, norm_topk_prob=norm_topk_prob)
    ref = Qwen3MoeSparseMoeBlock(hf)
    _random_(ref, 0.3)
    ours = SparseMoe(MoeConfig(8, 3, 16, norm_topk_prob=norm_topk_prob), 32)
    ours.router.weight.data.copy_(ref.gate.weight)
    ours.experts.gate_up.data.copy_(ref.experts.gate_up_proj)
    ours.experts.down.data.copy_(ref.experts.down_proj)
    x = torch.randn(1, 9, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(x[0]), ref(x)[0], rtol=1e-5, atol=1e-5)
        # The renormalisation is what differs between the two settings: weights sum to 1 only with it.
        _, weights = ours.route(x[0])
    assert torch.allclose(weights.sum(-1), torch.ones(9)) == norm_topk_prob


def test_gpt_oss_block() -> None:
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    hf = transformers.GptOssConfig(hidden_size=32, intermediate_size=16, num_local_experts=8, num_experts_per_tok=4)
    ref = GptOssMLP(hf)
    _random_(ref, 0.5)
    cfg = MoeConfig(8, 4, 16, routing="topk_softmax", activation="swiglu_oai", router_bias=True, expert_bias=True)
    ours = SparseMoe(cfg, 32)
    ours.router.weight.data.copy_(ref.router.weight)
    ours.router.bias.data.copy_(ref.router.bias)
    gate_up = ref.experts.gate_up_proj.transpose(1, 2)  # [E, 2I, H], gate and up rows interleaved
    ours.experts.gate_up.data.copy_(torch.cat([gate_up[:, ::2], gate_up[:, 1::2]], 1))
    bias = ref.experts.gate_up_proj_bias
    ours.experts.gate_up_bias.data.copy_(torch.cat([bias[:, ::2], bias[:, 1::2]], 1))
    ours.experts.down.data.copy_(ref.experts.down_proj.transpose(1, 2))
    ours.experts.down_bias.data.copy_(ref.experts.down_proj_bias)
    x = torch.randn(1, 9, 32, generator=torch.Generator().manual_seed(1)) * 4  # large enough to clamp
    with torch.no_grad():
        out = ref(x)
        out = out[0] if isinstance(out, tuple) else out
        torch.testing.assert_close(ours(x[0]), out[0], rtol=1e-4, atol=1e-4)


def test_bad_config_names_the_field() -> None:
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MoeConfig(4, 5, 16)
    with pytest.raises(ValueError, match="routing"):
        MoeConfig(4, 2, 16, routing="sigmoid")
