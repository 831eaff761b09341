"""Serving a GGUF file within the file's size: a file that cannot fit is refused before loading,
naming the sizes; repacked tensors' mapped pages leave the process; large projections repack a
chunk at a time, to the same panels."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from bench.random_blocks import random_blocks
from engine import LLM
from engine.execution import host_memory
from engine.execution.host_memory import HostMemory
from engine.execution.weights import quantized_weight
from engine.execution.weights.checkpoint import gguf_path
from engine.execution.weights.gguf_file import GGUFFile
from engine.execution.weights.quantized_weight import QuantizedWeight
from tests.gguf_samples import write_gguf

T = GGMLQuantizationType


@pytest.mark.parametrize("quant_type", [T.Q8_0, T.Q4_K, T.Q6_K])
def test_a_projection_repacked_in_chunks_has_the_same_panels(quant_type: T, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = random_blocks(quant_type, 100, 256, np.random.default_rng(0))  # 100 rows: the last panel padded
    bias = torch.arange(100, dtype=torch.float32)
    whole = QuantizedWeight.pack(blocks, quant_type, 256, bias)
    monkeypatch.setattr(quantized_weight, "PACK_ROWS", 32)
    chunked = QuantizedWeight.pack(blocks, quant_type, 256, bias)
    assert torch.equal(chunked.data, whole.data) and torch.equal(chunked.bias, whole.bias)
    assert (chunked.out_features, chunked.in_features, chunked.quant_type) == (100, 256, quant_type)


@pytest.mark.parametrize(("quant_type", "record_bytes"), [(T.Q4_K, 16 * 144), (T.Q5_K, 16 * 176)])
def test_k_quant_panels_hold_exactly_the_files_bytes(quant_type: T, record_bytes: int) -> None:
    """The memory bound (file + KV + 0.5 GB) needs the weights to take no more than the file: Q4_K's
    and Q5_K's 6-bit scales and minimums stay 6 bits, a record is 16 of the file's super-blocks."""
    blocks = random_blocks(quant_type, 64, 3 * 256, np.random.default_rng(1))
    weight = QuantizedWeight.pack(blocks, quant_type, 3 * 256)
    assert tuple(weight.data.shape) == (4, 3, record_bytes)
    assert weight.num_bytes == blocks.nbytes
    fields = weight.fields()
    assert fields.sc.max() == 63 and fields.mn.max() == 63  # the top bits are there to lose


def _mapped_rss(path: Path) -> int:
    """Bytes of path's mappings resident in this process (/proc/self/smaps)."""
    rss, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1].isdigit() or line[:1] in "abcdef" and "-" in line.split()[0]:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            rss += int(line.split()[1]) * 1024
    return rss


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps (Linux)")
def test_released_tensors_leave_the_process_and_still_read_the_same(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    hidden, vocab = 256, 8192  # an 8192 x 256 Q8_0 embedding: 2.2 MB
    path = write_gguf(tmp_path / "m.gguf", "llama", {"block_count": 1, "embedding_length": hidden,
                                                       "attention.head_count": 4, "vocab_size": vocab},
                      {"token_embd.weight": (random_blocks(T.Q8_0, vocab, hidden, rng), T.Q8_0)})
    gguf = GGUFFile(path)
    (embedding,) = list(gguf.tensors())
    before = embedding.data.copy()
    assert int(embedding.data.sum(dtype=np.int64)) > 0  # every page read in
    assert _mapped_rss(path) >= embedding.data.nbytes
    gguf.release([embedding])
    assert _mapped_rss(path) < embedding.data.nbytes // 4  # at most the header's pages and a boundary page
    assert np.array_equal(embedding.data, before)  # faulted back in from the file


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_available_memory_is_meminfo_or_a_cgroup_limit_whichever_is_less(tmp_path: Path) -> None:
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    _write(proc / "meminfo", "MemTotal:       24000000 kB\nMemAvailable:    8000000 kB\n")
    _write(proc / "self" / "cgroup", "0::/job/worker\n")
    _write(cgroup / "cgroup.controllers", "cpu memory\n")
    assert HostMemory.read(proc, cgroup) == HostMemory(8_000_000 * 1024, "MemAvailable")  # no limits set
    worker, job = cgroup / "job" / "worker", cgroup / "job"
    _write(worker / "memory.max", "max\n")
    _write(job / "memory.max", f"{3 * 2**30}\n")
    _write(job / "memory.current", f"{2**30}\n")
    _write(job / "memory.stat", "anon 100\ninactive_file 1000\nactive_file 5\n")
    # the ancestor's limit binds: 3 GiB - 1 GiB used + its reclaimable inactive file pages
    assert HostMemory.read(proc, cgroup) == HostMemory(2 * 2**30 + 1000, f"the memory cgroup {job}'s limit")
    v1 = tmp_path / "v1"
    _write(proc / "self" / "cgroup", "4:memory:/box\n3:cpu:/\n")
    _write(v1 / "memory" / "box" / "memory.limit_in_bytes", "9223372036854771712\n")  # v1's "no limit"
    assert HostMemory.read(proc, v1).source == "MemAvailable"
    _write(v1 / "memory" / "box" / "memory.limit_in_bytes", f"{2**30}\n")
    _write(v1 / "memory" / "box" / "memory.usage_in_bytes", f"{2**29}\n")
    _write(v1 / "memory" / "box" / "memory.stat", "inactive_file 7\ntotal_inactive_file 4096\n")
    assert HostMemory.read(proc, v1).available_bytes == 2**29 + 4096
    assert HostMemory.read(tmp_path / "nothing", tmp_path / "nothing") is None  # not Linux: nothing refused


def test_a_file_larger_than_memory_is_refused_before_loading_naming_the_sizes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    path = gguf_path(None)  # the default model's own Q4_1 file
    weights = GGUFFile(path).resident_bytes(4, keep_blocks=True)
    limit = weights // 2
    loaded = []
    monkeypatch.setattr(host_memory.HostMemory, "read", classmethod(lambda cls: cls(limit, "a test's limit")))
    monkeypatch.setattr(GGUFFile, "tensors", lambda self: loaded.append(self) or iter(()))
    with pytest.raises(ValueError) as refused:
        LLM(str(path), quantization="gguf", num_kv_blocks=64)
    message = str(refused.value)
    assert message.startswith("model: GGUF file SmolLM2-135M-Instruct.Q4_1.gguf needs")
    assert f"its weights {weights / 2**30:.2f} GiB + the KV pool" in message
    assert f"more than the {limit / 2**30:.2f} GiB available (a test's limit)" in message
    assert not loaded, "refused before a tensor was read"
