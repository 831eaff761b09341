"""A MoE layer's experts on the CPU: the C++ MoeExperts op (engine/execution/backends/cpu_moe.py) against
models/moe.py's torch Experts loop, on real layer shapes with random weights:

    flock -x /tmp/minivllm-bench.lock python -m bench.moe_experts
    flock -x /tmp/minivllm-bench.lock python -m bench.moe_experts --shapes qwen3-30b-a3b --rows 1 --isa avx2

- qwen3-30b-a3b: H 2048, I 768, 128 experts, 8 a token, in Q4_K;
- gpt-oss-20b: H 2880, I 2880, 32 experts, 4 a token, in MXFP4 (its files' experts), Q8_0 and Q4_0.
Each call routes its rows to random experts (distinct per row), drawn anew each call from all E
experts, so a call's experts are mostly out of the caches as in a model's step (E experts' blocks
are many times the last-level cache). A row prints the median seconds per call, the bytes of the
routed experts' panels a call reads (each routed expert's gate_up and down once), and their GB/s,
beside the read bandwidth of a torch sum over 1 GiB (bench.batch1's bound). The torch loop runs
the same routes on float32 weights (the dequantized blocks) of the first few experts only, to
hold its memory to --torch-mb: its GB/s counts the float32 bytes it reads.
"""
from __future__ import annotations

import argparse
import logging
import statistics
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType

from bench.batch1 import bandwidth_buffer, read_bandwidths
from bench.random_blocks import random_blocks
from engine.execution.backends.cpu_moe import PackedExperts
from engine.execution.heap_policy import release_free_memory
from engine.execution.kernels import ISAS, load_cpu_kernels
from engine.execution.models.moe import Experts, MoeConfig
from engine.execution.weights.quantized_weight import QuantizedWeight

logger = logging.getLogger(__name__)
T = GGMLQuantizationType
# name: (hidden, intermediate, experts, experts per token, block types)
SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8, [T.Q4_K]), "gpt-oss-20b": (2880, 2880, 32, 4, [T.MXFP4, T.Q8_0, T.Q4_0])}


def random_routes(num_rows: int, k: int, num_experts: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = np.argsort(rng.random((num_rows, num_experts)), axis=1)[:, :k]
    weights = rng.random((num_rows, k)).astype(np.float32)
    return torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(weights / weights.sum(axis=1, keepdims=True))


def median_seconds(fn, routes: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor) -> float:
    fn(x, *routes[0])  # warm: scratch, threads
    times = []
    for ids, weights in routes:
        start = time.perf_counter()
        fn(x, ids, weights)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def quantized_experts(cfg: MoeConfig, hidden: int, quant_type: T, rng: np.random.Generator) -> Experts:
    """Experts as a GGUF load leaves them: float parameters on the meta device, random blocks attached."""
    size = cfg.intermediate_size
    with torch.device("meta"):
        experts = Experts(cfg, hidden)
    experts.quantized_gate_up = [QuantizedWeight.pack(random_blocks(quant_type, 2 * size, hidden, rng), quant_type, hidden)
                                 for _ in range(cfg.num_experts)]
    experts.quantized_down = [QuantizedWeight.pack(random_blocks(quant_type, hidden, size, rng), quant_type, size)
                              for _ in range(cfg.num_experts)]
    return experts


def torch_experts(quantized: Experts, num_experts: int) -> Experts:
    """The first num_experts of quantized's experts as a float32 torch Experts (their dequantized blocks)."""
    cfg = MoeConfig(**{**{f: getattr(quantized.cfg, f) for f in quantized.cfg.__slots__}, "num_experts": num_experts,
                       "num_experts_per_tok": min(num_experts, quantized.cfg.num_experts_per_tok)})
    hidden = quantized.quantized_gate_up[0].in_features
    experts = Experts(cfg, hidden)
    with torch.no_grad():
        for e in range(num_experts):
            experts.gate_up[e].copy_(quantized.quantized_gate_up[e].dequantize())
            experts.down[e].copy_(quantized.quantized_down[e].dequantize())
    return experts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of " + ", ".join(SHAPES))
    parser.add_argument("--rows", default="1,8", help="comma-separated tokens per call")
    parser.add_argument("--isa", default="best", choices=["best", *ISAS])
    parser.add_argument("--calls", type=int, default=30, help="timed calls per row")
    parser.add_argument("--threads", type=int, default=0, help="threads (0: torch's default)")
    parser.add_argument("--torch-mb", type=int, default=800, help="float32 MB the torch loop's experts may take")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("the C++ kernels do not build here")
    isa = kernels.best_isa() if args.isa == "best" else ISAS[args.isa]
    buffer = bandwidth_buffer()
    bound = max(read_bandwidths(buffer, 5)) / 1e9
    del buffer
    release_free_memory()
    rng = np.random.default_rng(0)
    print(f"threads {torch.get_num_threads()}, isa {args.isa if args.isa != 'best' else isa}, "
          f"read bandwidth (torch sum, 1 GiB): {bound:.1f} GB/s")
    print(f"{'shape':<15} {'type':<5} {'rows':>4} {'op ms':>8} {'MB read':>8} {'op GB/s':>8} "
          f"{'torch ms':>9} {'torch GB/s':>10} {'speedup':>7}")
    for name in args.shapes.split(","):
        hidden, size, num_experts, k, types = SHAPES[name]
        for quant_type in types:
            cfg = MoeConfig(num_experts=num_experts, num_experts_per_tok=k, intermediate_size=size)
            quantized = quantized_experts(cfg, hidden, quant_type, rng)
            packed = PackedExperts.from_experts(quantized, torch.float32, kernels, isa)
            float_bytes = 3 * hidden * size * 4
            num_torch = max(k, min(num_experts, args.torch_mb * 2**20 // float_bytes))
            reference = torch_experts(quantized, num_torch)
            for num_rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(num_rows, hidden, generator=torch.Generator().manual_seed(num_rows))
                routes = [random_routes(num_rows, k, num_experts, rng) for _ in range(args.calls)]
                seconds = median_seconds(packed, routes, x)
                read = statistics.median(packed.routed_bytes(ids) for ids, _ in routes)
                torch_routes = [random_routes(num_rows, k, num_torch, rng) for _ in range(args.calls)]
                torch_seconds = median_seconds(reference, torch_routes, x)
                torch_read = statistics.median(len(ids.unique()) * float_bytes for ids, _ in torch_routes)
                print(f"{name:<15} {quant_type.name:<5} {num_rows:>4} {seconds * 1e3:>8.3f} {read / 1e6:>8.1f} "
                      f"{read / seconds / 1e9:>8.1f} {torch_seconds * 1e3:>9.3f} "
                      f"{torch_read / torch_seconds / 1e9:>10.1f} {torch_seconds / seconds:>6.1f}x")
            del quantized, packed, reference
            release_free_memory()
    print(f"(torch loop: float32 dequantized weights of its first experts, at most {args.torch_mb} MB; its routes among those)")


if __name__ == "__main__":
    main()
