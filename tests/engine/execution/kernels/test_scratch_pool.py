"""The kernels' large scratch (scratch_pool.cpp): a product's output of 32 MiB or more comes from
blocks kept between calls, not mapped and faulted in afresh each time, and the blocks go back
when the engine falls idle."""
from __future__ import annotations

import resource

import torch

from engine.execution.weights.packed_weight import PackedWeight

_POOLED_BYTES = 32 << 20


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_a_large_output_reuses_the_kept_block_and_stays_exact(kernels) -> None:
    isa = kernels.best_isa()
    kernels.release_scratch()
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(4096, 64, generator=gen)
    panels = PackedWeight.pack(weight, None, torch.float32)
    x = torch.randn(2100, 64, generator=gen)  # output [2100, 4096] float32: 34.4 MB, over the threshold
    expected = x @ weight.T
    out = panels.linear(x, kernels, isa)
    assert out.numel() * 4 >= _POOLED_BYTES
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    assert kernels.num_kept_scratch_bytes() == 0  # in use
    del out
    kept = kernels.num_kept_scratch_bytes()
    assert kept >= 2100 * 4096 * 4  # whole 2 MiB units
    faults = _minor_faults()
    x2 = torch.randn(2050, 64, generator=gen)  # a smaller step (33.6 MB): the same block
    out = panels.linear(x2, kernels, isa)
    assert _minor_faults() - faults < 2000  # afresh, its 8,200 pages would each fault in
    torch.testing.assert_close(out, x2 @ weight.T, atol=1e-4, rtol=1e-4)
    assert kernels.num_kept_scratch_bytes() == 0
    del out
    assert kernels.num_kept_scratch_bytes() == kept
    assert kernels.release_scratch() == kept and kernels.num_kept_scratch_bytes() == 0


def test_small_outputs_are_not_kept(kernels) -> None:
    kernels.release_scratch()
    panels = PackedWeight.pack(torch.randn(256, 64), None, torch.float32)
    out = panels.linear(torch.randn(64, 64), kernels, kernels.best_isa())
    del out
    assert kernels.num_kept_scratch_bytes() == 0


def test_the_cpu_backend_frees_the_kept_blocks_when_idle(kernels) -> None:
    from engine.execution.backends.cpu_backend import CpuBackend

    out = PackedWeight.pack(torch.randn(4096, 64), None, torch.float32).linear(torch.randn(2100, 64), kernels,
                                                                               kernels.best_isa())
    del out
    assert kernels.num_kept_scratch_bytes() > 0
    backend = CpuBackend.__new__(CpuBackend)  # only its kernels: release_idle_memory reads nothing else
    backend.kernels = kernels
    backend.release_idle_memory()
    assert kernels.num_kept_scratch_bytes() == 0
