"""A step's distinct experts: each step's stats count, summed over the MoE layers, the experts
that transformers' own router logits send the step's tokens to (the torch experts and the C++
op alike); a dense model's steps count none."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from tests.tiny_model import build_tiny_family_model, family_config

PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 300, 12], [400, 2, 64, 128, 9]]  # token ids


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_family_model(tmp_path_factory.mktemp("moe") / "model", family_config("qwen3-moe"))


def _experts_by_hand(moe_dir: Path, sequences: list[list[int]], positions: list[slice],
                     last_layer_positions: list[slice] | None = None) -> int:
    """Per sparse layer, the distinct experts of the top k router logits at each sequence's
    positions (transformers' model, float32), summed over the layers. last_layer_positions: the
    model's last layer's, where they differ (past attention, the last layer runs only the rows
    the step reads)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(moe_dir), dtype=torch.float32).eval()
    assert model.config.num_hidden_layers == 4  # sparse layers 1 and 3: 3 is the last
    k = model.config.num_experts_per_tok
    last_positions = last_layer_positions or positions
    chosen: dict[int, set[int]] = {}
    with torch.no_grad():
        for i, ids in enumerate(sequences):
            out = model(torch.tensor([ids]), output_router_logits=True)
            for layer, logits in enumerate(out.router_logits):  # [tokens, E] per sparse layer
                where = last_positions[i] if layer == len(out.router_logits) - 1 else positions[i]
                chosen.setdefault(layer, set()).update(logits[where].topk(k, dim=-1).indices.flatten().tolist())
    assert len(chosen) == 2
    return sum(len(experts) for experts in chosen.values())


@pytest.mark.parametrize("backend", ["cpu", "torch"])  # the C++ experts op; the torch experts
def test_a_steps_experts_are_those_its_router_logits_choose(moe_dir: Path, backend: str) -> None:
    llm = LLM(str(moe_dir), backend=backend, num_kv_blocks=64, block_size=4, max_num_batched_tokens=64)
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)) for p in PROMPTS]
    outputs, prefill = engine.step()  # both prompts in one step
    assert prefill.num_prefill_tokens == sum(map(len, PROMPTS)) and prefill.num_moe_layers == 2
    first = {o.request_id: o.token_ids[0] for o in outputs}
    sequences = [p + [first[i]] for p, i in zip(PROMPTS, ids, strict=True)]
    expected = _experts_by_hand(moe_dir, sequences, [slice(0, len(p)) for p in PROMPTS],
                                [slice(len(p) - 1, len(p)) for p in PROMPTS])  # the last layer: each prompt's last row
    assert prefill.num_experts_touched == expected
    assert prefill.experts_touched_per_layer == expected / 2
    _, decode = engine.step()  # each sequence's first sampled token
    assert decode.num_decode_tokens == 2
    assert decode.num_experts_touched == _experts_by_hand(moe_dir, sequences, [slice(len(p), len(p) + 1)
                                                                              for p in PROMPTS])
    assert 2 * 2 <= decode.num_experts_touched <= 2 * 2 * 2  # k a token, per layer at most both tokens'
    assert engine.scheduler.cost_model.experts == (8, 2)  # the step cost model predicts experts touched


def test_a_dense_models_steps_touch_no_experts(tiny_llm: LLM) -> None:
    engine = tiny_llm.engine
    engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    _, stats = engine.step()
    assert stats.num_prefill_tokens and stats.num_moe_layers == 0 and stats.num_experts_touched == 0
    assert stats.experts_touched_per_layer is None
    assert engine.scheduler.cost_model.experts is None  # the seven token features alone
    while engine.has_unfinished_requests():
        engine.step()
