"""GGUF files of Qwen3 and Gemma 3 as llama.cpp's own converter writes them (tests.field_gguf: tiny
random checkpoints with their families' real tokenizer kinds, converted by convert_hf_to_gguf.py):
every tensor maps to its checkpoint's Hugging Face name and holds that tensor's values (Gemma's
norms as 1 + w, the query and key rows in Hugging Face's order), at each output type; the config,
tokenizer, chat template and end-of-turn tokens read from the metadata are the checkpoint's own."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from engine.execution.weights.checkpoint import write_gguf_metadata
from engine.execution.weights.gguf_file import GGUFFile
from engine.execution.weights.gguf_loader import hf_name
from tests.field_gguf import field_gguf

T = GGMLQuantizationType
# Qwen3's files carry a 151,936-token embedding: its 16-bit conversions add little the Gemma ones
# do not check, for half a minute each
FILES = [("qwen3", "f32"), ("qwen3", "q8_0"), ("gemma3", "f32"), ("gemma3", "q8_0"), ("gemma3", "bf16"),
         ("gemma3", "f16")]


def _source_state(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(hf_dir / "model.safetensors"))


def _values(t) -> np.ndarray:
    if t.is_blocks:
        return dequantize(t.data, t.quant_type).reshape(t.shape)
    return np.asarray(t.data, dtype=np.float32).reshape(t.shape)


@pytest.mark.parametrize(("family", "outtype"), FILES, ids=[f"{f}-{o}" for f, o in FILES])
def test_each_tensor_is_its_checkpoints_own_under_its_hugging_face_name(family: str, outtype: str) -> None:
    """Row for row: llama.cpp permutes the query / key rows of llama-architecture files only, and a
    reader that reordered these would part from q_proj / k_proj here."""
    path, hf_dir = field_gguf(family, outtype)
    source = _source_state(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    file = GGUFFile(path)  # its tensors' shapes checked against the metadata: heads 32 wide, not 64 / 4
    assert file.architecture == family
    shapes = file.expected_shapes()
    assert shapes["attn_q"] == (128, 64) and shapes["attn_k"] == (64, 64) and shapes["attn_q_norm"] == (32,)
    seen = {}
    for t in file.tensors():
        name = hf_name(t.name, family)
        assert name in source, (t.name, name)
        seen[name] = t
    expected_names = set(source) - ({"lm_head.weight"} if config["tie_word_embeddings"] else set())
    assert set(seen) == expected_names
    types = {seen[name].quant_type for name in seen if seen[name].data.ndim == 2 and not name.endswith("norm.weight")}
    assert types == {{"f32": T.F32, "f16": T.F16, "q8_0": T.Q8_0, "bf16": T.F32}[outtype]}  # bf16: read as f32
    for name, t in seen.items():
        want = source[name].float().numpy()
        if family == "gemma3" and name.endswith("norm.weight"):
            want = want + np.float32(1)  # Gemma's (1 + w), stored shifted
        got = _values(t)
        assert got.shape == want.shape, name
        if t.data.ndim == 1 or outtype == "f32":  # norms stay float32
            assert np.array_equal(got, want), name
        elif outtype == "q8_0":
            # half a step of each 32-wide block's scale (amax / 127), plus that scale's own float16
            # rounding (2^-11 relative) times the largest multiple, 127
            step = np.abs(want.reshape(want.shape[0], -1, 32)).max(axis=-1, keepdims=True) / 127
            bound = step * (0.5 + 127 * 2.0 ** -11)
            assert np.all(np.abs(got - want).reshape(step.shape[0], -1, 32) <= bound), name
        else:
            rtol = {"f16": 2.0 ** -11, "bf16": 2.0 ** -8}[outtype]
            assert np.allclose(got, want, rtol=rtol, atol=1e-7), name
            assert not np.array_equal(got, want), name  # rounded: the 16-bit values were read as such


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def metadata_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the directory write_gguf_metadata makes of the family's f32 file, the source checkpoint)"""
    path, hf_dir = field_gguf(request.param, "f32")
    target = tmp_path_factory.mktemp(request.param) / "meta"
    write_gguf_metadata(path, target)
    return target, hf_dir


def test_config_from_the_metadata_is_the_checkpoints(metadata_dir: tuple[Path, Path]) -> None:
    from transformers import AutoConfig

    target, hf_dir = metadata_dir
    ours, source = AutoConfig.from_pretrained(str(target)), AutoConfig.from_pretrained(str(hf_dir))
    assert ours.model_type == source.model_type
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "tie_word_embeddings", "max_position_embeddings"):
        assert getattr(ours, field) == getattr(source, field), field
    assert ours.rms_norm_eps == pytest.approx(source.rms_norm_eps)  # stored as float32
    assert ours.rope_parameters == source.rope_parameters
    if source.model_type == "gemma3_text":
        assert ours.query_pre_attn_scalar == source.query_pre_attn_scalar == 32  # not transformers' default, 256
        assert ours.sliding_window == source.sliding_window
        assert ours.layer_types == source.layer_types  # every sixth layer global, as llama.cpp takes it


def test_tokenizer_chat_template_and_end_of_turn_are_the_checkpoints(metadata_dir: tuple[Path, Path]) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    target, hf_dir = metadata_dir
    ours, source = AutoTokenizer.from_pretrained(str(target)), AutoTokenizer.from_pretrained(str(hf_dir))
    texts = ["Hello world! The quick brown fox jumps over the lazy dog.", " leading space,  two spaces\n\nnewlines",
             "Unicode: café, naïve, 你好, 世界, emoji 🙂 and accents éèê.", "def main():\n    print(\"hello\")\n",
             "Numbers: 0 1 2 3 10 100 1000 3.14159", "<start_of_turn>user\nhi<end_of_turn>\n<|im_start|>x<|im_end|>"]
    for text in texts:
        assert ours.encode(text) == source.encode(text), text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == \
            source.decode(source.encode(text), skip_special_tokens=False)
    messages = [{"role": "user", "content": "Who wrote Hamlet?"}, {"role": "assistant", "content": "Shakespeare."},
                {"role": "user", "content": "When?"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        source.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    eos = GenerationConfig.from_pretrained(str(target)).eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    if "gemma" in ours.__class__.__name__.lower():  # its turns end in <end_of_turn>, its text in <eos>
        assert eos == {source.convert_tokens_to_ids("<eos>"), source.convert_tokens_to_ids("<end_of_turn>")}
    else:
        assert eos == {source.convert_tokens_to_ids("<|im_end|>")}


def test_gemma3_linear_rope_scaling_is_read(tmp_path: Path) -> None:
    """Gemma 3 4B and up scale their global layers' positions linearly (factor 8): the converter
    writes rope.scaling.type / .factor, which transformers' reading drops."""
    import shutil

    from transformers import AutoConfig

    from engine.execution.weights.gguf_config import gguf_config
    from tests.field_gguf import convert_hf_to_gguf

    hf_dir = shutil.copytree(field_gguf("gemma3", "f32")[1], tmp_path / "hf")
    config = json.loads((hf_dir / "config.json").read_text())
    config["rope_parameters"]["full_attention"] = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    (hf_dir / "config.json").write_text(json.dumps(config))
    ours = gguf_config(GGUFFile(convert_hf_to_gguf(hf_dir, tmp_path / "m.gguf", "f32")))
    assert ours.rope_parameters == AutoConfig.from_pretrained(str(hf_dir)).rope_parameters
    assert ours.rope_parameters["full_attention"]["factor"] == 8.0


@pytest.mark.parametrize(("metadata", "sliding"), [
    ({"attention.sliding_window": 8}, [True] * 5 + [False] + [True] * 5 + [False]),  # llama.cpp's default: every 6th
    ({"attention.sliding_window": 8, "attention.sliding_window_pattern": 4}, [True, True, True, False] * 3),
    ({}, [False] * 12),  # no window: every layer global (transformers would slide over its default 4096)
])
def test_gemma3_layer_kinds_are_llama_cpps(tmp_path: Path, metadata: dict[str, int], sliding: list[bool]) -> None:
    from engine.execution.weights.gguf_config import _gemma3_layer_types
    from tests.gguf_samples import write_gguf

    path = write_gguf(tmp_path / "m.gguf", "gemma3", {"block_count": 12, "embedding_length": 64,
                                                       "attention.head_count": 4, **metadata}, {})
    assert _gemma3_layer_types(GGUFFile(path), 12) == ["sliding_attention" if s else "full_attention" for s in sliding]
