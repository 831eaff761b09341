"""gpt-oss GGUF files as llama.cpp's own converter writes them (tests.field_gguf: a tiny random
gpt-oss checkpoint with the Qwen tokenizer standing in for o200k; its experts in MXFP4, as OpenAI
released gpt-oss, for the MXFP4 file): every tensor comes back under its transformers name and in
its layout (the converter splits the interleaved gate/up experts, transposes them and the down
experts; hf_float_tensors, quantization none's reading, puts them back), the config read from the
metadata is the checkpoint's, greedy output from the float32 file is token-exact against
transformers' generate() on the checkpoint and the Q8_0 file's parts from it only at near-ties.
Served as blocks (quantization auto with the C++ kernels), a file's experts stay the file's blocks
(MXFP4 or Q8_0) in PackedExperts on the experts op, no float copy of them made, and its
log-probabilities stay within rounding's reach of the same file served dequantized."""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from engine import LLM, SamplingParams
from engine.execution.backends.cpu_moe import PackedExperts
from engine.execution.weights.gguf_config import gguf_config
from engine.execution.weights.gguf_file import GGUFFile
from engine.execution.weights.gguf_loader import hf_float_tensors
from engine.execution.weights.quantized_weight import QuantizedWeight
from tests.field_gguf import field_gguf
from tests.helpers import token_logprobs, transformers_greedy

T = GGMLQuantizationType
PROMPTS = [[5, 9, 13], list(range(1000, 1037)), [42] * 7 + list(range(600, 620))]
NUM_NEW = 16


def _source_state(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(hf_dir / "model.safetensors"))


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_each_tensor_comes_back_as_the_checkpoints_own(outtype: str) -> None:
    path, hf_dir = field_gguf("gpt-oss", outtype)
    source = _source_state(hf_dir)
    file = GGUFFile(path)
    assert file.architecture == "gpt-oss"
    got = dict(hf_float_tensors(file))
    assert set(got) == set(source)
    for name, want in source.items():
        want = want.float()
        assert got[name].shape == want.shape, name
        if outtype == "f32" or want.dim() == 1 or name.endswith("_bias") or "router" in name:
            assert torch.equal(got[name], want), name  # 1-D tensors and the router stay float32
        else:  # Q8_0 blocks of 32 along each stored row: within half a step of the block's scale
            err = (got[name] - want).abs().max()
            assert 0 < err <= want.abs().max() / 127, name


def test_the_config_is_the_checkpoints() -> None:
    path, hf_dir = field_gguf("gpt-oss", "f32")
    want = json.loads((hf_dir / "config.json").read_text())
    config = gguf_config(GGUFFile(path))
    assert config.model_type == "gpt_oss"
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "num_local_experts", "num_experts_per_tok", "sliding_window",
                "layer_types", "tie_word_embeddings", "max_position_embeddings"):
        assert getattr(config, key) == want[key], key
    assert config.rope_parameters == want["rope_parameters"]
    assert config.rms_norm_eps == pytest.approx(want["rms_norm_eps"])


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    _, hf_dir = field_gguf("gpt-oss", "f32")
    return transformers_greedy(hf_dir, PROMPTS, NUM_NEW, attn_implementation="eager")


@pytest.fixture(scope="module")
def dequantized() -> Iterator[Callable[[str, str], LLM]]:
    """(family, outtype) -> that file served from its values in float32 (quantization none), made once a module."""
    llms: dict[tuple[str, str], LLM] = {}

    def get(family: str, outtype: str) -> LLM:
        if (family, outtype) not in llms:
            llms[family, outtype] = LLM(str(field_gguf(family, outtype)[0]), num_kv_blocks=256, block_size=4,
                                        quantization="none")
        return llms[family, outtype]

    yield get
    llms.clear()


def _generate(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True))
    return [o.token_ids for o in outs]


# Median and largest move of a token's log-probability from the float32 file to the Q8_0 one,
# teacher-forced on the float32 answers. Measured: 0.14 and 2.6 nats. The same checkpoint with its
# sinks dropped moved them by 0.89 and 4.4, with its experts' gate and up read as halves instead of
# interleaved by 4.1 and 10.1.
_Q8_BOUNDS = (0.35, 4.0)


def test_greedy_from_the_files(reference: list[list[int]], dequantized: Callable[[str, str], LLM]) -> None:
    """The float32 file token-exact against transformers on the checkpoint; the Q8_0 file's
    log-probabilities of those answers within rounding's reach of the float32 file's (its greedy
    answers part early on this random model: a router choice near a tie flips two experts)."""
    exact = dequantized("gpt-oss", "f32")
    assert _generate(exact) == reference
    quantized = dequantized("gpt-oss", "q8_0")
    sequences = [prompt + ref for prompt, ref in zip(PROMPTS, reference, strict=True)]
    diffs = [abs(a - b) for a, b in zip(token_logprobs(exact, sequences),
                                        token_logprobs(quantized, sequences), strict=True)]
    median, most = _Q8_BOUNDS
    assert 0 < float(np.median(diffs)) < median and max(diffs) < most, (float(np.median(diffs)), max(diffs))


def test_quantization_auto_serves_the_float_file_token_exact(reference: list[list[int]]) -> None:
    """A .gguf path keeps its blocks where the C++ kernels run them: the float32 file's projections and
    experts go to float panels (the experts op's), token-exact against transformers still."""
    llm = LLM(str(field_gguf("gpt-oss", "f32")[0]), num_kv_blocks=256, block_size=4)
    backend = llm.engine.runner.backend
    if backend.kernels is None:
        pytest.skip("quantization auto keeps GGUF blocks only with the C++ kernels")
    assert backend.gguf is True and backend.fused is not None  # the fused layers, sinks in their attention
    assert all(isinstance(layer.moe.experts, PackedExperts) for layer in llm.engine.runner.model.layers)
    assert _generate(llm) == reference


@pytest.mark.parametrize(("family", "outtype", "expert_type", "attention_type"),
                         [("gpt-oss-mxfp4", "f32", T.MXFP4, None), ("gpt-oss", "q8_0", T.Q8_0, T.Q8_0)],
                         ids=["mxfp4-experts", "q8_0"])
def test_a_block_file_serves_its_experts_as_blocks(family: str, outtype: str, expert_type: T, attention_type: T | None,
                                                   dequantized: Callable[[str, str], LLM]) -> None:
    """Every layer's experts are the file's blocks on the experts op (with their biases), no float
    expert tensor left, its attention projections the file's blocks (or float panels) with their biases; teacher-forced on the dequantized file's greedy answers, log-probabilities
    within the Q8_0 file's bounds of that file's (measured: median 0.06 and largest 1.1 nats with
    MXFP4 experts, 0.19 and 1.9 with every projection in Q8_0: the kernels' int8 activations are the
    only rounding added); greedy answers repeat, and do not depend on the batch."""
    path = field_gguf(family, outtype)[0]
    blocks = LLM(str(path), num_kv_blocks=256, block_size=4)
    if blocks.engine.runner.backend.kernels is None:
        pytest.skip("quantization auto keeps GGUF blocks only with the C++ kernels")
    model = blocks.engine.runner.model
    for layer in model.layers:
        for projection in (layer.qkv_proj, layer.o_proj):
            panels = projection.panels
            assert (panels.quant_type if isinstance(panels, QuantizedWeight) else None) == attention_type
            assert panels.bias is not None
        experts = layer.moe.experts
        assert isinstance(experts, PackedExperts)
        for panels in experts.gate_up_panels + experts.down_panels:
            assert isinstance(panels, QuantizedWeight) and panels.quant_type == expert_type
            assert panels.data.dtype == torch.uint8 and panels.bias is not None
    assert [name for name, _ in [*model.named_parameters(), *model.named_buffers()] if ".experts." in name] == []
    float_llm = dequantized(family, outtype)
    sequences = [prompt + answer for prompt, answer in zip(PROMPTS, _generate(float_llm), strict=True)]
    diffs = [abs(a - b) for a, b in zip(token_logprobs(float_llm, sequences),
                                        token_logprobs(blocks, sequences), strict=True)]
    median, most = _Q8_BOUNDS
    assert 0 < float(np.median(diffs)) < median and max(diffs) < most, (float(np.median(diffs)), max(diffs))
    first = _generate(blocks)
    assert _generate(blocks) == first
    assert [_generate_one(blocks, prompt) for prompt in PROMPTS] == first


def _generate_one(llm: LLM, prompt: list[int]) -> list[int]:
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True))[0].token_ids


def test_mxfp4_experts_are_the_gguf_packages_blocks() -> None:
    """The converter's MXFP4 experts are the gguf package's MXFP4 quantization of the checkpoint's
    float experts (tests.field_gguf encodes them so; the converter moves OpenAI's layout back to
    ggml's), gate and up taken apart; and they load for quantization none as the package
    dequantizes them, in transformers' layout."""
    file = GGUFFile(field_gguf("gpt-oss-mxfp4", "f32")[0])
    stored = {t.name: t for t in file.tensors()}
    assert all(stored[f"blk.1.ffn_{part}_exps.weight"].quant_type == T.MXFP4 for part in ("gate", "up", "down"))
    floats = _source_state(field_gguf("gpt-oss", "f32")[1])  # the same checkpoint's float experts
    rows = floats["model.layers.1.mlp.experts.gate_up_proj"].float().transpose(1, 2)  # [E, 2I, H], interleaved
    down = floats["model.layers.1.mlp.experts.down_proj"].float().transpose(1, 2)  # [E, H, I]

    def blocks(t: torch.Tensor) -> np.ndarray:  # [E, rows, K] -> the package's MXFP4 blocks, as bytes
        return quantize(np.ascontiguousarray(t.numpy()).reshape(-1, t.shape[-1]), T.MXFP4).reshape(-1)

    def file_bytes(name: str) -> np.ndarray:
        return stored[name].data.reshape(-1)

    assert np.array_equal(file_bytes("blk.1.ffn_gate_exps.weight"), blocks(rows[:, ::2]))
    assert np.array_equal(file_bytes("blk.1.ffn_up_exps.weight"), blocks(rows[:, 1::2]))
    assert np.array_equal(file_bytes("blk.1.ffn_down_exps.weight"), blocks(down))
    assert not np.array_equal(file_bytes("blk.1.ffn_gate_exps.weight"), blocks(rows[:, 1::2]))

    got = dict(hf_float_tensors(file))

    def values(name: str) -> torch.Tensor:  # [E, rows, cols] as the file stores it, in float32
        t = stored[name]
        return torch.from_numpy(dequantize(t.data, T.MXFP4).reshape(t.shape))

    gate, up = values("blk.1.ffn_gate_exps.weight"), values("blk.1.ffn_up_exps.weight")
    gate_up = got["model.layers.1.mlp.experts.gate_up_proj"]  # [E, H, 2I], gate and up interleaved
    assert torch.equal(gate_up[..., ::2], gate.transpose(1, 2)) and torch.equal(gate_up[..., 1::2], up.transpose(1, 2))
    assert torch.equal(got["model.layers.1.mlp.experts.down_proj"], values("blk.1.ffn_down_exps.weight").transpose(1, 2))
    # and near the checkpoint's values (4-bit: a coarse bound), far from another expert's
    want = floats["model.layers.1.mlp.experts.gate_up_proj"].float()
    assert (gate_up - want).abs().mean() < 0.25 * want.abs().mean()
    assert (gate_up - want.roll(1, dims=0)).abs().mean() > 0.5 * want.abs().mean()
    # the MXFP4 checkpoint holds the float one's other tensors, biases included
    assert torch.equal(got["model.layers.1.mlp.experts.gate_up_proj_bias"],
                       floats["model.layers.1.mlp.experts.gate_up_proj_bias"].float())
    assert set(got) == set(floats)
