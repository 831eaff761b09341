"""The CUDA backend's host logic, on the CPU: backend choice, the KV pool's size from
gpu_memory_utilization, the decode graphs' buckets, and how a step's rows are staged into the
graphs' static buffers (padding to the bucket, the scratch slot, buffers reused). The graphs
themselves, the Triton kernels compiled and the engine on a GPU run in bench/gpu_check.sh."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine import EngineConfig
from engine.execution.backends import select_backend
from engine.execution.backends.cuda_backend import CudaBackend
from engine.execution.backends.cuda_graphs import DecodeGraphs, bucket_for, decode_buckets


def test_buckets_climb_to_max_num_seqs_which_always_has_its_own() -> None:
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert decode_buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert decode_buckets(1) == [1]
    buckets = decode_buckets(40)
    assert [bucket_for(b, buckets) for b in (1, 3, 5, 24, 25, 40)] == [1, 4, 8, 24, 32, 40]
    with pytest.raises(ValueError, match="batch"):
        bucket_for(41, buckets)


class _FakeGraph:
    """Records what the static buffers hold when the step replays it."""

    def __init__(self, graphs: DecodeGraphs, bucket: int) -> None:
        self.graphs, self.bucket, self.seen = graphs, bucket, []

    def replay(self) -> None:
        g, b = self.graphs, self.bucket
        self.seen.append({name: getattr(g, name)[:b].clone() for name in
                          ("token_ids", "positions", "slot_mapping", "context_lens", "block_tables")})


def _graphs(buckets: list[int]) -> DecodeGraphs:
    graphs = DecodeGraphs(model=None, kv_caches=[], block_size=4, max_blocks=5, buckets=buckets, scratch_slot=400,
                          device=torch.device("cpu"))
    for bucket in buckets:
        graphs.graphs[bucket] = _FakeGraph(graphs, bucket)
        graphs.logits[bucket] = torch.arange(bucket * 3, dtype=torch.float32).view(bucket, 3)
        graphs.argmax[bucket] = torch.arange(bucket) + 100
    return graphs


def test_a_step_is_padded_to_its_bucket_and_padding_writes_only_the_scratch_slot() -> None:
    graphs = _graphs([1, 4, 8])
    logits, argmax = graphs.step([11, 12, 13], [[[7, 2], [5], [9, 3, 1]]], [6, 2, 11], with_argmax=True)
    seen = graphs.graphs[4].seen[-1]
    assert seen["token_ids"].tolist() == [11, 12, 13, 0]
    assert seen["context_lens"].tolist() == [6, 2, 11, 0]  # a padded row attends to nothing
    assert seen["positions"].tolist() == [5, 1, 10, 0]
    # position p of a table: its block table[p // 4], offset p % 4; the padded row: the scratch slot
    assert seen["slot_mapping"].tolist() == [2 * 4 + 1, 5 * 4 + 1, 1 * 4 + 2, 400]
    assert seen["block_tables"].tolist() == [[7, 2, 0, 0, 0], [5, 0, 0, 0, 0], [9, 3, 1, 0, 0], [0, 0, 0, 0, 0]]
    assert logits.shape == (3, 3) and torch.equal(logits, graphs.logits[4][:3])
    assert argmax == [100, 101, 102]
    assert graphs.step([1], [[[3]]], [1], with_argmax=False)[1] is None


def test_static_buffers_are_reused_and_a_smaller_step_clears_what_a_larger_left() -> None:
    graphs = _graphs([2, 8])
    pointers = [getattr(graphs, n).data_ptr() for n in ("token_ids", "block_tables", "context_lens")]
    graphs.step([1] * 7, [[[1, 2, 3, 4, 5]] * 7], [20] * 7, with_argmax=False)
    graphs.step([4, 5], [[[6], [8]]], [3, 4], with_argmax=False)
    seen = graphs.graphs[2].seen[-1]
    assert seen["block_tables"].tolist() == [[6, 0, 0, 0, 0], [8, 0, 0, 0, 0]]
    assert seen["context_lens"].tolist() == [3, 4]
    assert [getattr(graphs, n).data_ptr() for n in ("token_ids", "block_tables", "context_lens")] == pointers


def test_kv_pool_takes_what_gpu_memory_utilization_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 10 * gib)  # this process: the weights
    backend = SimpleNamespace(config=EngineConfig(gpu_memory_utilization=0.5), device="cuda")
    assert CudaBackend.kv_cache_bytes(backend) == 40 * gib - 10 * gib - 2 * gib  # less the activation reserve
    backend.config = EngineConfig(gpu_memory_utilization=1.0)  # never past what is free
    assert CudaBackend.kv_cache_bytes(backend) == 70 * gib - 2 * gib
    backend.config = EngineConfig(gpu_memory_utilization=0.1)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CudaBackend.kv_cache_bytes(backend)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusals of a machine without a GPU")
def test_cuda_is_refused_by_name_without_a_gpu() -> None:
    model_config = SimpleNamespace()
    for options, field in (({"device": "cuda"}, "device"), ({"backend": "cuda"}, "device"),
                           ({"backend": "cpu", "device": "cuda"}, "backend")):
        with pytest.raises(ValueError, match=f"^{field}"):
            select_backend(EngineConfig(**options), model_config)
    with pytest.raises(ValueError, match="^backend"):
        EngineConfig(backend="tpu")
