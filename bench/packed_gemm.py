"""The panel GEMM against oneDNN's packed GEMM on a model's four layer shapes (QKV, O,
gate/up or up, down), per row count, in GFLOP/s (best of 3), side by side in one run:

    python -m bench.packed_gemm                     # bfloat16: AVX-512 panels, vdpbf16ps, AMX tiles, oneDNN
    python -m bench.packed_gemm --dtype float32
    python -m bench.packed_gemm --shapes bge-small --rows 2048   # an encoder step's products
    python -m bench.packed_gemm --shapes bge-small --rows 2048 --per-shape   # each projection alone

The process's heap runs as a serving engine's does (heap_policy: buffers under 32 MiB reused from
the heap): under glibc's own raising threshold each product's output and rounded input were
often mapped and faulted in afresh, which took 2,048-row bf16 products from ~385 to ~330 GFLOP/s
here and measured the page faults, not the products an engine step runs.
"""
from __future__ import annotations

import argparse
import logging
import time

import torch

from engine.execution.heap_policy import STEP_MMAP_THRESHOLD_BYTES, fix_mmap_threshold
from engine.execution.kernels import ISAS, load_cpu_kernels
from engine.execution.weights.packed_weight import PackedWeight

logger = logging.getLogger(__name__)
# (K, N) of each model's projections
_SHAPES = {"smollm2-135m": [(576, 960), (576, 576), (576, 3072), (1536, 576)],
           "bge-small": [(384, 1152), (384, 384), (384, 1536), (1536, 384)],
           "qwen3-0.6b": [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024)]}
_ISA_NAMES = {level: name for name, level in ISAS.items()}


def best_time(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rows", default="1,8,32,64,128,512")
    parser.add_argument("--shapes", default="smollm2-135m", choices=sorted(_SHAPES))
    parser.add_argument("--per-shape", action="store_true",
                        help="each projection's rate alone, on this CPU's best path and oneDNN's")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    fix_mmap_threshold(STEP_MMAP_THRESHOLD_BYTES)
    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("the C++ kernels did not build")
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    shapes = _SHAPES[args.shapes]
    weights = [torch.randn(n, k, generator=gen) * 0.05 for k, n in shapes]
    panels = [PackedWeight.pack(w, None, dtype) for w in weights]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w.to(dtype)) for w in weights]
    isas = [i for i in (ISAS["avx512"], ISAS["avx512_bf16"], ISAS["amx"]) if i <= kernels.best_isa()] or [kernels.best_isa()]
    if args.per_shape:
        return per_shape(kernels, shapes, panels, onednn, [int(r) for r in args.rows.split(",")], dtype, gen)
    flops_per_row = 2 * sum(w.numel() for w in weights)
    for m in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(m, k, generator=gen) for k, _ in shapes]
        xs_native = [x.to(dtype) for x in xs]
        reps = max(3, 400 // m)
        parts = [f"M={m:4d}"]
        for isa in isas:
            def run_panels(isa: int = isa, xs: list[torch.Tensor] = xs) -> None:
                for x, p in zip(xs, panels, strict=True):
                    kernels.packed_linear(x, *p.as_args(), isa)
            t = best_time(run_panels, reps)
            parts.append(f"panels/{_ISA_NAMES[isa]} {m * flops_per_row / t / 1e9:7.1f}")
        def run_onednn(xs_native: list[torch.Tensor] = xs_native) -> None:
            for x, w in zip(xs_native, onednn, strict=True):
                torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        t = best_time(run_onednn, reps)
        parts.append(f"oneDNN {m * flops_per_row / t / 1e9:7.1f}")
        logger.info("%s  GFLOP/s", " | ".join(parts))


def per_shape(kernels, shapes: list[tuple[int, int]], panels: list[PackedWeight], onednn: list[torch.Tensor],
              rows: list[int], dtype: torch.dtype, gen: torch.Generator) -> None:
    """Each projection alone: the panels on the CPU's best path (float32 x in, rounded inside the
    call; float32 out) beside oneDNN's linear (x already in the panels' dtype; its output too)."""
    isa = kernels.best_isa()
    for (k, n), p, o in zip(shapes, panels, onednn, strict=True):
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            x_native = x.to(dtype)
            reps = max(3, 4000 // m)
            t_panels = best_time(lambda x=x, p=p: kernels.packed_linear(x, *p.as_args(), isa), reps)
            t_onednn = best_time(lambda x=x_native, o=o: torch.ops.mkldnn._linear_pointwise(x, o, None, "none", [], ""),
                                 reps)
            flops = 2 * m * k * n
            logger.info("[%5d -> %5d] M=%5d | panels/%s %7.1f | oneDNN %7.1f  GFLOP/s", k, n, m, _ISA_NAMES[isa],
                        flops / t_panels / 1e9, flops / t_onednn / 1e9)


if __name__ == "__main__":
    main()
