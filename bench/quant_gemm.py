"""GGUF's quantized blocks kept packed: the integer-dot kernels' weight streams in GB/s against
this machine's read bandwidth (a torch sum over 1 GiB on 2 MiB pages on all threads, bench.batch1's
bound) and the int8 panel kernel on the same shapes, side by side in one run:

    flock -x /tmp/minivllm-bench.lock python -m bench.quant_gemm
    flock -x /tmp/minivllm-bench.lock python -m bench.quant_gemm --rows 1,8,32 --isa avx2
    flock -x /tmp/minivllm-bench.lock python -m bench.quant_gemm --sets gpt-oss --types Q4_0,MXFP4

Each shape set is a chain of products over distinct copies of its weights, more bytes than the
caches hold, run by one team of threads that waits for each product's end as a decode step's
members do (kernels/linear_chain.cpp): the 135M set is SmolLM2-135M's layer (QKV, O, gate/up,
down), the 1B set Llama-3.2-1B's MLP shapes (2048 -> 8192, 8192 -> 2048), the gpt-oss set one
gpt-oss-20b expert's down projection (2880 -> 2880; its MXFP4 blocks beside Q4_0's). GB/s counts
the weights' bytes as the kernels hold them.
"""
from __future__ import annotations

import argparse
import logging

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from bench.batch1 import bandwidth_buffer, read_bandwidths
from bench.random_blocks import random_blocks
from engine.execution.kernels import ISAS, load_cpu_kernels
from engine.execution.weights.packed_weight import PackedWeight
from engine.execution.weights.quantized_weight import QuantizedWeight

logger = logging.getLogger(__name__)
T = GGMLQuantizationType
_SETS = {"135M layer": [(576, 960), (576, 576), (576, 3072), (1536, 576)],  # (K, N)
         "1B MLP": [(2048, 8192), (8192, 2048)], "gpt-oss": [(2880, 2880)]}
_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.MXFP4]
_MIN_BYTES = 320 << 20  # per chain: several times the last-level cache


class ReadBandwidth:
    """GB/s of a torch sum over bench.batch1's bandwidth buffer (1 GiB of float32 on 2 MiB pages,
    the bound the other benchmarks' rows are held to) on all threads: the best seen so far.
    Measured between the kernels' runs, so that both get the machine's quiet moments (it is shared)."""

    def __init__(self) -> None:
        self.x = bandwidth_buffer()
        self.best = 0.0
        self.measure()

    def measure(self) -> float:
        rate = read_bandwidths(self.x, 1)[0] / 1e9
        self.best = max(self.best, rate)
        return rate


def best_seconds(fn, bandwidth: ReadBandwidth, tries: int = 7) -> float:
    """The best of `tries` runs of fn (-> seconds), each after a measure of the read bandwidth."""
    fn()
    best = float("inf")
    for _ in range(tries):
        bandwidth.measure()
        best = min(best, fn())
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1", help="comma-separated row counts (M)")
    parser.add_argument("--isa", default="best", choices=["best", *ISAS])
    parser.add_argument("--types", default=",".join(t.name for t in _TYPES))
    parser.add_argument("--sets", default=",".join(_SETS), help="comma-separated shape sets")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("the C++ kernels did not build")
    isa = kernels.best_isa() if args.isa == "best" else ISAS[args.isa]
    types = [T[name] for name in args.types.split(",")]
    rng = np.random.default_rng(0)
    bandwidth = ReadBandwidth()
    logger.info("%d threads; kernels: %s", torch.get_num_threads(),
                next(name for name, level in ISAS.items() if level == isa))
    results: list[tuple[str, float, float]] = []  # (what, GB/s, GFLOP/s)
    sets = args.sets.split(",")
    unknown = [name for name in sets if name not in _SETS]
    if unknown:
        raise SystemExit(f"--sets: unknown {', '.join(unknown)}; known: {', '.join(_SETS)}")
    for set_name, shapes in ((name, _SETS[name]) for name in sets):
        chains: dict[str, tuple[list, int]] = {}
        for quant_type in types:
            if any(k % GGML_QUANT_SIZES[quant_type][0] for k, _ in shapes):
                continue  # K not a multiple of the super-block (llama.cpp falls back to another type there)
            packed = [QuantizedWeight.pack(random_blocks(quant_type, n, k, rng), quant_type, k) for k, n in shapes]
            chains[quant_type.name] = _repeat(packed, lambda w: w.num_bytes, lambda w: (w.data, int(w.quant_type),
                                                                                         w.out_features, w.in_features))
        int8 = [PackedWeight.pack(torch.randn(n, k) * 0.05, None, torch.int8) for k, n in shapes]
        chains["int8 panels"] = _repeat(int8, lambda w: w.num_bytes, lambda w: (w.as_args(), w.in_features))
        max_k = max(k for k, _ in shapes)
        num_weights = sum(k * n for k, n in shapes)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, max_k)
            for name, (weights, num_bytes) in chains.items():
                chain = kernels.packed_chain_seconds if name == "int8 panels" else kernels.quant_chain_seconds
                seconds = best_seconds(lambda chain=chain, weights=weights, x=x: chain(x, weights, 3, isa), bandwidth)
                what = f"{set_name:<10} M={m:<3d} {name:<11} {num_bytes / 1e6:6.1f} MB {seconds * 1e3:8.3f} ms"
                results.append((what, num_bytes / seconds / 1e9,
                                2 * m * num_weights * len(weights) / len(shapes) / seconds / 1e9))
                logger.info("%s  %6.1f GB/s  %7.1f GFLOP/s", what, *results[-1][1:])
    logger.info("read bandwidth (torch sum over 1 GiB on 2 MiB pages, %d threads, best of the run): %.1f GB/s",
                torch.get_num_threads(), bandwidth.best)
    for what, rate, flops in results:
        logger.info("%s  %6.1f GB/s  %5.1f %% of read  %7.1f GFLOP/s", what, rate, 100 * rate / bandwidth.best, flops)


def _repeat(first: list, bytes_of, args_of) -> tuple[list, int]:
    """The chain's arguments: first's weights, then distinct copies of them until it holds _MIN_BYTES."""
    per_round = sum(bytes_of(w) for w in first)
    rounds = max(1, -(-_MIN_BYTES // per_round))
    weights = []
    for r in range(rounds):
        for w in first:
            args = args_of(w)
            if r > 0:  # a copy of the data: the same values at other addresses
                args = _copied(args)
            weights.append(args)
    return weights, rounds * per_round


def _copied(args: tuple) -> tuple:
    if isinstance(args[0], tuple):  # (PackedLinear, K)
        (data, scales, bias, n), k = args
        return (data.clone(), scales, bias, n), k
    data, *rest = args
    return (data.clone(), *rest)


if __name__ == "__main__":
    main()
