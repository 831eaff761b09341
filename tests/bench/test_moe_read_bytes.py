"""A batch-1 decode step of a mixture-of-experts model reads k of each layer's E experts: the
read bound of `bench.offline_throughput --single-stream` counts k/E of the experts' bytes, for
minivllm's packed experts and for a GGUF file's stacked `*_exps` tensors alike."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from bench.batch1 import weight_bytes_per_token
from bench.peers import gguf_weight_bytes_per_token
from engine import LLM
from tests.gguf_samples import T, write_gguf
from tests.tiny_model import build_tiny_family_model, family_config


@pytest.mark.parametrize("backend", ["cpu", "torch"])  # the C++ experts op's panels; the torch experts
def test_a_moe_models_token_reads_k_of_e_experts(tmp_path: Path, backend: str) -> None:
    from transformers import AutoModelForCausalLM

    path = build_tiny_family_model(tmp_path / "model", family_config("qwen3-moe"))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    cfg = hf.config
    experts = sum(p.numel() * 4 for name, p in hf.named_parameters() if ".experts." in name)
    embedding = hf.model.embed_tokens.weight.numel() * 4
    tied = cfg.tie_word_embeddings
    dense = sum(p.numel() * 4 for p in hf.parameters()) - experts - (0 if tied else embedding)
    llm = LLM(str(path), backend=backend, dtype="float32")
    expected = dense + experts * cfg.num_experts_per_tok // cfg.num_experts
    assert weight_bytes_per_token(llm) == pytest.approx(expected, rel=0.02)
    # a count of every expert would be 4x that much here (2 of 8 experts a token)
    assert weight_bytes_per_token(llm) < dense + experts // 2


def test_a_gguf_files_stacked_experts_count_k_of_e(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 255, (8, 64, 2 * 34), dtype=np.uint8)  # 8 experts of 64 rows, Q8_0 rows of 64
    tensors = {"token_embd.weight": (rng.standard_normal((300, 64), dtype=np.float32), T.F32),
               "output.weight": (rng.integers(0, 255, (300, 2 * 34), dtype=np.uint8), T.Q8_0),
               "blk.0.ffn_up_exps.weight": (blocks, T.Q8_0),
               "blk.0.ffn_gate_inp.weight": (rng.standard_normal((8, 64), dtype=np.float32), T.F32)}
    path = write_gguf(tmp_path / "moe.gguf", "qwen3moe", {"block_count": 1, "expert_count": 8,
                                                          "expert_used_count": 2}, tensors)
    router, lm_head, experts = 8 * 64 * 4, 300 * 2 * 34, blocks.size
    assert gguf_weight_bytes_per_token(path) == router + lm_head + experts * 2 // 8
