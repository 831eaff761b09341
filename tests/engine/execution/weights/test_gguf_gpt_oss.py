"""gpt-oss GGUF files as llama.cpp's own converter writes them (tests.field_gguf: a tiny random
gpt-oss checkpoint with the Qwen tokenizer standing in for o200k): every tensor comes back under
its transformers name and in its layout (the converter splits the interleaved gate/up experts,
transposes them and the down experts; hf_float_tensors puts them back), the config read from the
metadata is the checkpoint's, greedy output from the float32 file is token-exact against
transformers' generate() on the checkpoint and the Q8_0 file's parts from it only at near-ties;
experts stored as MXFP4 blocks load as the gguf package dequantizes them."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

from engine import LLM, SamplingParams
from engine.execution.weights.gguf_config import gguf_config
from engine.execution.weights.gguf_file import GGUFFile
from engine.execution.weights.gguf_loader import hf_float_tensors
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


def _generate(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True))
    return [o.token_ids for o in outs]


# Median and largest move of a token's log-probability from the float32 file to the Q8_0 one,
# teacher-forced on the float32 answers. Measured: 0.14 and 2.6 nats. The same checkpoint with its
# sinks dropped moved them by 0.89 and 4.4, with its experts' gate and up read as halves instead of
# interleaved by 4.1 and 10.1.
_Q8_BOUNDS = (0.35, 4.0)


def test_greedy_from_the_files(reference: list[list[int]]) -> None:
    """The float32 file token-exact against transformers on the checkpoint; the Q8_0 file's
    log-probabilities of those answers within rounding's reach of the float32 file's (its greedy
    answers part early on this random model: a router choice near a tie flips two experts)."""
    options = dict(num_kv_blocks=256, block_size=4, quantization="none")
    exact = LLM(str(field_gguf("gpt-oss", "f32")[0]), **options)
    assert _generate(exact) == reference
    quantized = LLM(str(field_gguf("gpt-oss", "q8_0")[0]), **options)
    sequences = [prompt + ref for prompt, ref in zip(PROMPTS, reference, strict=True)]
    diffs = [abs(a - b) for a, b in zip(token_logprobs(exact, sequences),
                                        token_logprobs(quantized, sequences), strict=True)]
    median, most = _Q8_BOUNDS
    assert 0 < float(np.median(diffs)) < median and max(diffs) < most, (float(np.median(diffs)), max(diffs))


def test_quantization_auto_serves_the_file_dequantized(reference: list[list[int]]) -> None:
    """A .gguf path keeps its blocks where the fused C++ layers run them; they do not run gpt-oss,
    so its file is served from its values in float32 instead of refused."""
    llm = LLM(str(field_gguf("gpt-oss", "f32")[0]), num_kv_blocks=256, block_size=4)
    backend = llm.engine.runner.backend
    if backend.kernels is None:
        pytest.skip("quantization auto keeps GGUF blocks only with the C++ kernels")
    assert llm.engine.runner.backend.gguf is False and backend.max_fused_tokens == 0
    assert _generate(llm) == reference


def _with_mxfp4_experts(src: Path, dst: Path) -> Path:
    """src rewritten with its experts' weights as MXFP4 blocks (gpt-oss's released type)."""
    reader = GGUFReader(str(src))
    writer = GGUFWriter(str(dst), "gpt-oss")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), value_type, sub_type=sub_type)
    for t in reader.tensors:
        data = np.asarray(t.data)
        if "_exps.weight" in t.name:
            data = quantize(data.astype(np.float32), T.MXFP4)
            writer.add_tensor(t.name, data, raw_dtype=T.MXFP4)
        else:
            writer.add_tensor(t.name, data, raw_dtype=T(t.tensor_type))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_mxfp4_experts_load_as_the_gguf_package_dequantizes_them(tmp_path: Path) -> None:
    src, hf_dir = field_gguf("gpt-oss", "f32")
    path = _with_mxfp4_experts(src, tmp_path / "gpt-oss-mxfp4.gguf")
    file = GGUFFile(path)
    stored = {t.name: t for t in GGUFReader(str(path)).tensors}
    assert T(stored["blk.0.ffn_gate_exps.weight"].tensor_type) == T.MXFP4
    got = dict(hf_float_tensors(file))
    source = _source_state(hf_dir)

    def dequantized(name: str) -> torch.Tensor:  # [E, rows, cols] as the file stores it, in float32
        t = stored[name]
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        return torch.from_numpy(dequantize(np.asarray(t.data), T.MXFP4).reshape(shape))

    gate, up = dequantized("blk.1.ffn_gate_exps.weight"), dequantized("blk.1.ffn_up_exps.weight")
    gate_up = got["model.layers.1.mlp.experts.gate_up_proj"]  # [E, H, 2I], gate and up interleaved
    assert torch.equal(gate_up[..., ::2], gate.transpose(1, 2)) and torch.equal(gate_up[..., 1::2], up.transpose(1, 2))
    down = dequantized("blk.1.ffn_down_exps.weight")
    assert torch.equal(got["model.layers.1.mlp.experts.down_proj"], down.transpose(1, 2))
    # and near the checkpoint's values (4-bit: a coarse bound), far from another expert's
    want = source["model.layers.1.mlp.experts.gate_up_proj"].float()
    assert (gate_up - want).abs().mean() < 0.25 * want.abs().mean()
    assert (gate_up - want.roll(1, dims=0)).abs().mean() > 0.5 * want.abs().mean()
