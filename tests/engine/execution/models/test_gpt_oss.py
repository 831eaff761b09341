"""gpt-oss (model_type gpt_oss) is token-exact (greedy, float32) against transformers' generate()
on a tiny random model (tests/tiny_model.py: window and full layers alternating with a window
shorter than the prompts, 8 experts with 2 a token, YaRN RoPE, sinks): through the pure-torch
reference backend, the CPU backend's fused layers (the sinks in their attention kernels, the
router, routing and experts op in the layer's call), and its module path with torch's attention
and with the C++ attention kernels, whole and chunked prefill. The sinks, the experts' layout and
int8's refusal are checked apart."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.execution.backends.cpu_moe import PackedExperts
from tests.helpers import rewrite_checkpoint, transformers_greedy
from tests.tiny_model import build_tiny_family_model, family_config

PROMPTS = [[5, 9, 13], list(range(10, 47)), [42] * 7 + list(range(60, 80)), list(range(100, 300, 7))]
NUM_NEW = 24


@pytest.fixture(scope="module")
def gpt_oss_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_family_model(tmp_path_factory.mktemp("gpt-oss") / "model", family_config("gpt-oss"))


@pytest.fixture(scope="module")
def reference(gpt_oss_model: Path) -> list[list[int]]:
    return transformers_greedy(gpt_oss_model, PROMPTS, NUM_NEW, attn_implementation="eager")


def _generate(path: Path, budget: int = 512, **options) -> list[list[int]]:
    llm = LLM(str(path), num_kv_blocks=256, block_size=4, max_num_batched_tokens=budget, **options)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True))
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("path_kind", ["fused", "cpp-modules", "torch", "reference"])
@pytest.mark.parametrize("budget", [512, 16], ids=["whole-prefill", "chunked-prefill"])
def test_greedy_matches_transformers(gpt_oss_model: Path, reference: list[list[int]], path_kind: str, budget: int,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    if path_kind == "torch":
        monkeypatch.setenv("MINIVLLM_DISABLE_CPP_KERNELS", "1")
    fused = {"max_fused_tokens": 0} if path_kind == "cpp-modules" else {}
    llm = LLM(str(gpt_oss_model), num_kv_blocks=256, block_size=4, max_num_batched_tokens=budget,
              backend="torch" if path_kind == "reference" else "auto", **fused)
    backend = llm.engine.runner.backend
    is_cpp = path_kind in ("fused", "cpp-modules")
    assert (backend.kernels is None) == (not is_cpp)
    # the fused layers take the steps up to their default size; none on the others
    assert (getattr(backend, "fused", None) is not None and backend.max_fused_tokens > 0) == (path_kind == "fused")
    experts = [layer.moe.experts for layer in llm.engine.runner.model.layers]
    # on the panels its experts run on the experts op (biases and the clamped SwiGLU), not torch's loop;
    # with max_fused_tokens 0 nothing is packed: the modules run with the C++ attention kernels
    assert all(isinstance(e, PackedExperts) for e in experts) == (path_kind == "fused")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True))
    for prompt, out, ref in zip(PROMPTS, outs, reference, strict=True):
        assert out.token_ids == ref, f"prompt of {len(prompt)} tokens diverged"


def test_the_sinks_and_the_expert_layout_change_the_output(gpt_oss_model: Path, reference: list[list[int]],
                                                           tmp_path: Path) -> None:
    """Guards the comparison above against a sink or an interleaved gate/up silently mishandled:
    the same weights with the sinks pushed to -1e4 (no weight left on them) generate something
    else, and so do the experts' gate and up columns read as halves instead of interleaved."""
    def drop_sinks(w: dict) -> None:
        for name in [n for n in w if n.endswith("self_attn.sinks")]:
            w[name] = torch.full_like(w[name], -1e4)

    def halves(w: dict) -> None:  # the interleaved columns reordered so that a halves reading gets them right
        for name in [n for n in w if n.endswith("experts.gate_up_proj") or n.endswith("experts.gate_up_proj_bias")]:
            t = w[name]
            half = t.shape[-1] // 2
            w[name] = torch.stack((t[..., :half], t[..., half:]), dim=-1).flatten(-2).contiguous()

    for edit in (drop_sinks, halves):
        changed = rewrite_checkpoint(gpt_oss_model, tmp_path / edit.__name__, edit)
        assert _generate(changed, backend="torch") != reference, edit.__name__


def test_quantized_fused_layers_refuse_gpt_oss(gpt_oss_model: Path) -> None:
    with pytest.raises(ValueError, match="quantization: int8 .* gpt_oss"):
        LLM(str(gpt_oss_model), num_kv_blocks=16, quantization="int8")


def test_a_missing_expert_tensor_fails_loading_and_names_it(gpt_oss_model: Path, tmp_path: Path) -> None:
    name = "model.layers.1.mlp.experts.down_proj_bias"
    broken = rewrite_checkpoint(gpt_oss_model, tmp_path / "m", lambda w: w.pop(name))
    # named by expert, as the loader splits transformers' stacked experts (and a GGUF file's)
    with pytest.raises(ValueError, match=r"missing weights: model\.layers\.1\.mlp\.experts\.0\.down_proj\.bias, "
                                         r"model\.layers\.1\.mlp\.experts\.1\.down_proj\.bias"):
        LLM(str(broken), num_kv_blocks=16, backend="torch")


def test_the_config_is_gpt_oss(gpt_oss_model: Path) -> None:
    """The tiny model exercises what the real one has: alternating windows shorter than the prompts, YaRN."""
    config = json.loads((gpt_oss_model / "config.json").read_text())
    assert config["model_type"] == "gpt_oss"
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert config["sliding_window"] < max(len(p) for p in PROMPTS)
    assert config["rope_parameters"]["rope_type"] == "yarn"
