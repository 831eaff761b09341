"""Serving a GGUF file as it is (quantization gguf): a tiny GGUF of each model family, written by the
`gguf` package here, loads with its config, tokenizer and chat template from the file's metadata,
keeps its projections' and embedding's blocks (no float copy), and generates the same greedy
tokens as its safetensors twin (the same weights dequantized to float32), on the best ISA path
and on AVX2, through the fused decode step, the per-layer kernels and chunked prefill."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from engine import LLM, EngineConfig, SamplingParams
from engine.execution.backends.cpu_gguf import QuantEmbedding
from engine.execution.resolved_config import resolve_config
from engine.execution.weights.quantized_parts import QuantizedParts
from engine.execution.weights.quantized_weight import QuantizedWeight
from tests.gguf_samples import write_family_gguf
from tests.helpers import assert_parts_only_at_ties, token_logprobs
from tests.tiny_model import build_tiny_family_model

T = GGMLQuantizationType
_COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)
PROMPTS = [[5, 9, 13], list(range(10, 47)), [42] * 7 + list(range(60, 80)), list(range(100, 300, 7))]
NUM_NEW = 24


def _config(family: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if family == "llama-tied":
        return LlamaConfig(**_COMMON, tie_word_embeddings=True)
    if family == "qwen2-untied":  # q/k/v biases
        return Qwen2Config(**_COMMON, tie_word_embeddings=False)
    if family == "mistral":
        return MistralConfig(**_COMMON, tie_word_embeddings=False, sliding_window=None)
    raise ValueError(family)


# family -> the block type its file is written in
FAMILIES = {"llama-tied": T.Q4_1, "qwen2-untied": T.Q8_0, "mistral": T.Q4_0}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp(request.param)
    hf_dir = build_tiny_family_model(root / "hf", _config(request.param))
    gguf = write_family_gguf(hf_dir, root / f"{request.param}.gguf", root / "twin", FAMILIES[request.param])
    return gguf, root / "twin"


@pytest.fixture(scope="module")
def twin(family_gguf: tuple[Path, Path]) -> LLM:
    return LLM(str(family_gguf[1]), num_kv_blocks=64)


@pytest.fixture(scope="module")
def twin_tokens(twin: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    return [out.token_ids for out in twin.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def native_tokens(family_gguf: tuple[Path, Path]) -> list[list[int]]:
    llm = LLM(str(family_gguf[0]), num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    return [out.token_ids for out in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("path", ["fused", "fused-avx2", "per-layer", "torch-modules", "chunked"])
def test_each_family_gguf_generates_its_dequantized_twins_tokens(family_gguf: tuple[Path, Path], twin: LLM,
                                                                  twin_tokens: list[list[int]],
                                                                  native_tokens: list[list[int]], path: str) -> None:
    # torch-modules: no fused C++ layers, each projection a quant_linear call from torch's modules
    options = {"fused-avx2": {"kernel_isa": "avx2"}, "chunked": {"max_num_batched_tokens": 16},
               "torch-modules": {"max_fused_tokens": 0}}.get(path, {})
    llm = LLM(str(family_gguf[0]), num_kv_blocks=64, **options)
    assert llm.engine.config.quantization == "gguf"  # auto: a .gguf path is served as its blocks
    if path == "per-layer":  # no decode-only C++ step: each layer's kernels, then torch's logits
        llm.engine.runner.backend.max_decode_rows = 0
    model = llm.engine.runner.model
    projections = [m for layer in model.layers for m in layer.projections] + [model.lm_head]
    assert all(isinstance(m.panels, QuantizedWeight) and m.weight is None for m in projections)
    assert isinstance(model.embed_tokens, QuantEmbedding)
    outs = [out.token_ids for out in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NUM_NEW,
                                                                          ignore_eos=True))]
    if path == "fused-avx2":  # the same integer sums and float steps as the VNNI tiles
        assert outs == native_tokens
    assert_parts_only_at_ties(twin, PROMPTS, outs, twin_tokens, NUM_NEW)


def test_gguf_logits_equal_the_dequantized_twins_within_the_activation_rounding(
        family_gguf: tuple[Path, Path]) -> None:
    ids = list(range(20, 60))
    a = token_logprobs(LLM(str(family_gguf[0]), num_kv_blocks=64), [ids])
    b = token_logprobs(LLM(str(family_gguf[1]), num_kv_blocks=64), [ids])
    # against logits spanning tens of nats; a product's relative error is about half a percent
    assert np.abs(a - b).max() < 1.5 and np.abs(a - b).mean() < 0.3, (np.abs(a - b).max(), np.abs(a - b).mean())
    assert not np.array_equal(a, b)  # the native path did run its own (integer) products


def test_config_tokenizer_and_chat_template_come_from_the_files_metadata(family_gguf: tuple[Path, Path]) -> None:
    from transformers import AutoTokenizer

    llm = LLM(str(family_gguf[0]), num_kv_blocks=64)
    twin_tokenizer = AutoTokenizer.from_pretrained(str(family_gguf[1]))
    text = "Hello world! The quick brown fox."
    assert llm.tokenizer.encode(text) == twin_tokenizer.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert llm.engine.model_info().has_chat_template
    assert llm.engine.apply_chat_template(messages) == twin_tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert llm.engine.eos_token_ids == frozenset({twin_tokenizer.convert_tokens_to_ids("<|im_end|>")})


def test_quantization_none_serves_a_gguf_dequantized(family_gguf: tuple[Path, Path],
                                                     twin_tokens: list[list[int]]) -> None:
    if family_gguf[0].stem == "mistral":
        pytest.skip("transformers' GGUF conversion knows no 'mistral' architecture (llama.cpp writes Mistral "
                    "models as 'llama'); the native path reads it")
    llm = LLM(str(family_gguf[0]), num_kv_blocks=64, quantization="none")
    assert not isinstance(llm.engine.runner.model.lm_head.panels, QuantizedWeight)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True))
    assert [out.token_ids for out in outs] == twin_tokens  # float32 both: the same values, the same tokens


def test_auto_serves_a_gguf_dequantized_where_the_kernels_do_not_build(family_gguf: tuple[Path, Path],
                                                                       twin_tokens: list[list[int]],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """auto picks the blocks only where the kernels that multiply them exist: without a compiler the
    file is still served (dequantized, as before native serving), not refused."""
    if family_gguf[0].stem == "mistral":
        pytest.skip("transformers' GGUF conversion knows no 'mistral' architecture; the native path reads it")
    import engine.execution.kernels as kernels

    monkeypatch.setattr(kernels, "load_cpu_kernels", lambda: None)
    assert resolve_config(EngineConfig(model=str(family_gguf[0]))).quantization == "none"
    assert resolve_config(EngineConfig(model=str(family_gguf[0]), backend="cpu")).quantization == "none"
    llm = LLM(str(family_gguf[0]), num_kv_blocks=64)
    assert llm.engine.runner.backend.kernels is None
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True))
    assert [out.token_ids for out in outs] == twin_tokens
    monkeypatch.undo()
    assert resolve_config(EngineConfig(model=str(family_gguf[0]))).quantization == "gguf"


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A qwen2 file (q/k/v biases) whose V is Q4_0 beside Q8_0 (k-quant mixes store V in another
    type than Q and K), and its float32 twin (the exact reference for its values). (V in Q8_0 beside
    Q4_0 serves as closely, but this tiny model's greedy answers on Q4_0 Q and K meet near-ties within a
    few tokens, its plain Q4_0 file's as well.)"""
    root = tmp_path_factory.mktemp("mixed")
    hf_dir = build_tiny_family_model(root / "hf", _config("qwen2-untied"))
    return write_family_gguf(hf_dir, root / "mixed.gguf", root / "twin", T.Q8_0, {".attn_v.": T.Q4_0}), root / "twin"


@pytest.mark.parametrize("path", ["fused", "per-layer", "torch-modules"])
def test_a_fused_projection_of_mixed_block_types_is_served_in_the_files_types(
        mixed_gguf: tuple[Path, Path], path: str, caplog: pytest.LogCaptureFixture) -> None:
    """The fused QKV projection keeps q and k as Q8_0 panels and v as Q4_0 ones (no requantization)
    and generates its float32 twin's tokens within the activation rounding, on each path."""
    options = {"torch-modules": {"max_fused_tokens": 0}}.get(path, {})
    with caplog.at_level(logging.INFO, logger="engine.execution.weights.gguf_loader"):
        llm = LLM(str(mixed_gguf[0]), num_kv_blocks=64, **options)
    assert "requantized" not in caplog.text
    if path == "per-layer":
        llm.engine.runner.backend.max_decode_rows = 0
    for layer in llm.engine.runner.model.layers:
        qkv = layer.qkv_proj.panels
        assert isinstance(qkv, QuantizedParts) and qkv.part_types == (T.Q8_0, T.Q4_0) and qkv.part_rows == (96, 32)
        assert qkv.bias is not None
        assert layer.o_proj.panels.quant_type == T.Q8_0  # the rest keeps its own blocks
    twin = LLM(str(mixed_gguf[1]), num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    outs = [out.token_ids for out in llm.generate(PROMPTS, params)]
    assert_parts_only_at_ties(twin, PROMPTS, outs, [out.token_ids for out in twin.generate(PROMPTS, params)], NUM_NEW)
    ids = list(range(20, 60))
    a, b = token_logprobs(llm, [ids]), token_logprobs(twin, [ids])
    assert np.abs(a - b).max() < 1.5 and np.abs(a - b).mean() < 0.3, (np.abs(a - b).max(), np.abs(a - b).mean())


def test_unsupported_architecture_and_truncated_files_fail_naming_the_problem(family_gguf: tuple[Path, Path],
                                                                             tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    data = family_gguf[0].read_bytes()
    truncated.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(ValueError, match="truncated"):
        LLM(str(truncated), num_kv_blocks=64)
    from tests.gguf_samples import write_gguf

    other = write_gguf(tmp_path / "phi.gguf", "phi3", {"block_count": 1, "embedding_length": 64,
                                                       "attention.head_count": 4}, {})
    with pytest.raises(ValueError, match="architecture 'phi3'"):
        LLM(str(other), num_kv_blocks=64)


def test_gguf_mode_is_validated(family_gguf: tuple[Path, Path], tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="quantization gguf serves a .gguf file"):
        EngineConfig(model=str(tiny_model_dir), quantization="gguf")
    # the default model by its name is its own GGUF file, as with no model at all
    assert EngineConfig(model="SmolLM2-135M-Instruct", quantization="gguf").quantization == "gguf"
    assert resolve_config(EngineConfig(model=str(tiny_model_dir))).quantization == "none"
    assert resolve_config(EngineConfig(model="x.gguf", enable_cpp_kernels=False)).quantization == "none"
    assert resolve_config(EngineConfig(model="x.gguf", backend="torch")).quantization == "none"
    assert resolve_config(EngineConfig(model="x.gguf", backend="cpu")).quantization == "gguf"
    assert resolve_config(EngineConfig(model=None)).quantization == "none"  # the default model: float32 unless asked
    with pytest.raises(ValueError, match="quantization: gguf"):
        LLM(str(family_gguf[0]), quantization="gguf", backend="torch")


def test_embedding_rows_are_the_files_dequantized_rows(family_gguf: tuple[Path, Path]) -> None:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    llm = LLM(str(family_gguf[0]), num_kv_blocks=64)
    token_embd = next(t for t in GGUFReader(str(family_gguf[0])).tensors if t.name == "token_embd.weight")
    expected = dequantize(np.array(token_embd.data), T(token_embd.tensor_type)).reshape(-1, 64)
    ids = torch.tensor([0, 1, 17, 255, 511])
    rows = llm.engine.runner.model.embed_tokens(ids)
    assert torch.equal(rows, torch.from_numpy(expected[ids.numpy()]).float())

