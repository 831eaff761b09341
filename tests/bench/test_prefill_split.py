"""bench.prefill_split on the tiny model: the parts it times must account for the chunk steps'
forward (neither missing a path's calls nor counting one twice), on the fused C++ layers and on
the torch modules alike, and be put back afterwards."""
from __future__ import annotations

from pathlib import Path

import pytest

from bench.prefill_split import PROJECTIONS, measure, projection_rates
from engine import LLM
from engine.execution.backends import cpu_fused
from engine.execution.models import llama as llama_module


# The fused layers asked for steps of any size: by default a CPU without AVX-512 runs float32 steps
# past 64 tokens on torch's modules (oneDNN wins there), and the 160-token chunks would test them twice.
@pytest.mark.parametrize("max_fused_tokens", [1 << 20, 0], ids=["fused-layers", "torch-modules"])
def test_parts_account_for_the_forward(tiny_model_dir: Path, max_fused_tokens: int) -> None:
    # chunks of 160: on the tiny model a call's fixed host cost is most of a 64-token chunk's time
    # (the timed parts were 52-61 % of the forward there, and fell under half in one make test)
    llm = LLM(str(tiny_model_dir), max_num_batched_tokens=160, enable_prefix_caching=False, num_kv_blocks=64,
              max_fused_tokens=max_fused_tokens)
    is_fused = llm.engine.runner.backend.fused is not None and max_fused_tokens > 0
    original_attention, original_kernels = llama_module.attention, getattr(llm.engine.runner.backend.fused, "kernels", None)
    # the median of three rounds: on a tiny model one scheduler hiccup can outweigh every timed part
    result = measure(llm, [3 + i % 200 for i in range(450)], num_rounds=3)
    timer = result["timer"]
    assert len([s for s in result["steps"] if s.num_prefill_tokens > 0]) == 3  # 450 tokens in chunks of 160
    parts = {name for name, seconds in timer.seconds.items() if seconds > 0}
    expected = {"attn inputs", "attn outputs", "attention"} if is_fused else {*PROJECTIONS, "attention", "norms"}
    assert expected <= parts
    assert timer.flops["attention"] > 0
    accounted = sum(timer.seconds.values())
    # The parts lie inside the forward; how much of it they are is a timing (the untimed Python
    # between them grows on a loaded machine: 46 % once in a make test, 52-61 % alone), so the
    # lower bound only says the hooks cover the forward's main parts.
    assert 0.3 * result["forward"] < accounted <= 1.02 * result["forward"]
    # put back: the module's attention and the kernels, and no hooks left on the projections
    assert llama_module.attention is original_attention and cpu_fused.attention.__name__ == "attention"
    if is_fused:
        assert llm.engine.runner.backend.fused.kernels is original_kernels
    layer = llm.engine.runner.model.layers[0]
    assert not layer.qkv_proj._forward_hooks and not layer.qkv_proj._forward_pre_hooks
    rates = projection_rates(llm, 16, repeats=1)
    assert set(rates) == set(PROJECTIONS) and all(seconds > 0 and rate > 0 for seconds, rate in rates.values())
