"""The C heap's policy (engine/execution/heap_policy.py): load temporaries go back to the OS, a
step's freed buffers stay for the next step, and the engine trims the steps' freed heap when it
falls idle."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[3]
# Each script runs in a fresh process (glibc's thresholds are per process and cannot be reset once
# fixed) with argv[1] its mode, and prints its RSS growth in MiB.
_PRELUDE = """
import ctypes, sys
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def fix(threshold, trim=None):  # the engine's policy, imported only in "fixed" modes (its package loads torch)
    from engine.execution import heap_policy
    assert heap_policy.fix_mmap_threshold(getattr(heap_policy, threshold), trim and getattr(heap_policy, trim))
def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
"""


def _rss_growth_mib(script: str, mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", _PRELUDE + script, mode], check=True, capture_output=True, text=True,
                         cwd=_REPO)
    return float(out.stdout.strip())


# A 16 MiB block freed raises glibc's own threshold to 16 MiB (as a load's first large free does);
# then 1 MiB temporaries, each followed by a small object that lives on (as a model's load
# interleaves them), are freed.
_INTERLEAVED_TEMPORARIES = """
if sys.argv[1] == "fixed":
    fix("LOAD_MMAP_THRESHOLD_BYTES")
big = libc.malloc(16 << 20); ctypes.memset(big, 1, 16 << 20); libc.free(big)
before = rss_mib()
temporaries, kept = [], []
for _ in range(200):
    block = libc.malloc(1 << 20); ctypes.memset(block, 1, 1 << 20); temporaries.append(block)
    small = libc.malloc(512); ctypes.memset(small, 1, 512); kept.append(small)
for block in temporaries:
    libc.free(block)
print(rss_mib() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_fixed_load_threshold_returns_freed_temporaries_between_live_objects() -> None:
    # glibc's own threshold keeps the 200 MiB of freed temporaries resident
    assert _rss_growth_mib(_INTERLEAVED_TEMPORARIES, "glibc") > 150
    assert _rss_growth_mib(_INTERLEAVED_TEMPORARIES, "fixed") < 20


# A step's 8 MiB buffer, freed at the heap's top: kept for the next step, or handed back, to be
# faulted in again, where the trim threshold stayed at glibc's 128 KiB.
_STEP_BUFFER = """
if sys.argv[1] == "fixed":
    fix("STEP_MMAP_THRESHOLD_BYTES")
else:
    libc.mallopt(-3, 32 << 20)  # the mmap threshold alone
before = rss_mib()
block = libc.malloc(8 << 20); ctypes.memset(block, 1, 8 << 20); libc.free(block)
print(rss_mib() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_the_step_threshold_keeps_a_freed_buffer_for_the_next_step() -> None:
    assert _rss_growth_mib(_STEP_BUFFER, "mmap-only") < 2  # trimmed at once: the next step faults its 8 MiB in again
    assert _rss_growth_mib(_STEP_BUFFER, "fixed") > 7


# A prefill step's buffers, each under the mmap threshold but together over glibc's trim
# threshold (64 MiB: twice it), freed at the end of a layer: handed back, and faulted in again by
# the next layer, unless the trim threshold is the engine's while serving.
_LAYER_BUFFERS = """
fix("STEP_MMAP_THRESHOLD_BYTES", "STEP_TRIM_THRESHOLD_BYTES" if sys.argv[1] == "serving" else None)
before = rss_mib()
blocks = [libc.malloc(30 << 20) for _ in range(3)]
for block in blocks:
    ctypes.memset(block, 1, 30 << 20)
for block in reversed(blocks):
    libc.free(block)
print(rss_mib() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_the_serving_trim_threshold_keeps_a_layers_buffers_for_the_next_layer() -> None:
    assert _rss_growth_mib(_LAYER_BUFFERS, "twice-the-threshold") < 30
    assert _rss_growth_mib(_LAYER_BUFFERS, "serving") > 85


def test_building_on_meta_skips_initializers_and_imports_no_compiler() -> None:
    """Initializing a meta embedding imports torch._dynamo and sympy (150 MB resident): meta_model runs none."""
    script = """
import sys, torch
from torch import nn
from engine.execution.models.meta_model import meta_model
init_normal = nn.init.normal_
model = meta_model(lambda size: nn.Sequential(nn.Embedding(size, 8), nn.Linear(8, 8), nn.LayerNorm(8)), 100)
assert all(p.is_meta for p in model.parameters())
assert nn.init.normal_ is init_normal  # restored
print("torch._dynamo" in sys.modules, "sympy" in sys.modules)
with torch.device("meta"):
    nn.Embedding(100, 8)
print("torch._dynamo" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True, cwd=_REPO)
    assert out.stdout.split() == ["False", "False", "True"]  # the last: why it matters


def test_the_engine_trims_the_heap_once_when_it_falls_idle(tiny_model_dir: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from engine import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), num_kv_blocks=64, block_size=4, max_num_batched_tokens=64)
    trims: list[int] = []
    monkeypatch.setattr(llm.engine.runner.backend, "release_idle_memory",
                        lambda: trims.append(llm.engine.scheduler.num_requests))
    llm.generate(["one two three", "four five"], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert trims == [0]  # once, after the last request finished: not on every step
